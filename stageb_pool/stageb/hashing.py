"""Content hashes and work-derived seeds: functions of their inputs, never of a rank, a pid or
a clock, which is what makes a run on 8 workers byte-identical to a run on 1."""

from __future__ import annotations

import hashlib

import msgspec

_canonical = msgspec.json.Encoder(order="sorted")


def canonical_json(value) -> bytes:
    return _canonical.encode(value)


def content_hash(value) -> str:
    """16 hex digits of sha256 over the canonical JSON: IPC de-duplication, cache, artifact rows."""
    return hashlib.sha256(canonical_json(value)).hexdigest()[:16]


def tickets_hash(tickets) -> str:
    """In the order given, which is the caller's identity: ``run.json`` hashes key order (what
    the run judged), ``state.json`` the run order (what a resume must reproduce)."""
    return content_hash([msgspec.to_builtins(t) for t in tickets])


def stable_seed(*parts) -> int:
    """A 63-bit seed from the parts' text, e.g. ``stable_seed(run_seed, "train", chunk, d, s)``."""
    text = "/".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1
