"""Where the Stage-B domain meets the pool and the run directory: the rollout runner, the rule
search, the baseline audit, the resume state and every artifact the parent writes."""
