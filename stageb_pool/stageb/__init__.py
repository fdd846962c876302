"""Stage-B's pure domain, from tickets to the gate and the proposer's text: no processes, torch or run directory."""
