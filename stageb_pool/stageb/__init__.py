"""Stage-B's pure domain: tickets, guidance and its edits, prompt profiles, the verdict
protocol and metrics, the gate, the rule proposer's text parts and the ticket pools.

No processes, no torch, no run directory: plain functions and msgspec values.
"""
