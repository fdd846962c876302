"""Content hashes and work-derived seeds.

Both are pure functions of their inputs, never of a rank, a pid or a clock: this is what
makes a run on 8 workers byte-identical to a run on 1.
"""

from __future__ import annotations

import hashlib

import msgspec

_canonical = msgspec.json.Encoder(order="sorted")


def canonical_json(value) -> bytes:
    """JSON bytes with dict keys sorted, so equal values always give equal bytes."""
    return _canonical.encode(value)


def content_hash(value) -> str:
    """16 hex digits of sha256 over the canonical JSON of ``value``: equal hashes are the
    same value everywhere (IPC de-duplication, the rollout cache, every artifact row)."""
    return hashlib.sha256(canonical_json(value)).hexdigest()[:16]


def tickets_hash(tickets) -> str:
    """``content_hash`` of the tickets (key, label, mission, summaries) in the order given.

    The order is the caller's statement of identity: ``run.json`` hashes the ticket set in
    key order (what the run judged, whatever the file order or seed); ``state.json`` hashes
    the run order, which a resumed search must reproduce exactly.
    """
    return content_hash([msgspec.to_builtins(t) for t in tickets])


def stable_seed(*parts) -> int:
    """A 63-bit seed from the parts' text, e.g. ``stable_seed(run_seed, "train", chunk, d, s)``."""
    text = "/".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1
