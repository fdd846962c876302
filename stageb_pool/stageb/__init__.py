"""Stage-B's pure domain: tickets, guidance, prompts, verdicts and metrics, the gate, the
proposer's text parts, the ticket pools. No processes, no torch, no run directory."""
