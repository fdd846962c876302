"""Shared values (``Pool.share``, e.g. the guidance), sent to each worker once: the parent's
store (``SharedStore``) and its LRU mirror of one worker's cache (``SharedCache``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import NamedTuple

from . import protocol
from .errors import FrameTooLarge

SHARED_CACHE_SIZE = 8  # distinct shared values each worker keeps (a baseline + candidates)


class SharedValue(NamedTuple):
    """A shared value encoded once (``Pool.share``), passed to ``submit`` in place of the value."""

    key: str
    data: bytes


class SharedStore:
    """Encoded shared values by key, each with the number of unfinished tasks using it."""

    def __init__(self, max_frame: int):
        self.max_frame = max_frame
        self._values: dict[str, list] = {}  # key -> [encoded value, tasks using it]

    def encode(self, value) -> SharedValue:
        """``value`` encoded and keyed by the hash of its bytes (equal encodings are one value)."""
        data = protocol.encode(value)
        return SharedValue(hashlib.sha256(data).hexdigest()[:16], data)

    def keys(self, shared: dict) -> dict[str, str]:
        """name -> key of shared values, each distinct value encoded once."""
        keys = {}
        for name, value in shared.items():
            key, data = value if isinstance(value, SharedValue) else self.encode(value)
            if key not in self._values:
                if len(data) > self.max_frame:
                    raise FrameTooLarge(len(data), self.max_frame, f"shared value {name!r}")
                self._values[key] = [data, 0]
            keys[name] = key
        return keys

    def acquire(self, keys: dict[str, str]) -> None:
        for key in keys.values():
            self._values[key][1] += 1

    def release(self, keys: dict[str, str]) -> None:
        """A task that used ``keys`` is finished: drop the values no other task needs."""
        for key in keys.values():
            entry = self._values[key]
            entry[1] -= 1
            if entry[1] == 0:
                del self._values[key]

    def data(self, key: str) -> bytes:
        return self._values[key][0]


class SharedCache:
    """The parent's bookkeeping of one worker's cache of shared values (least recently used first)."""

    def __init__(self, capacity: int = SHARED_CACHE_SIZE):
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    def admit(self, needed: dict[str, str]) -> list[tuple[str, list[str]]]:
        """``(key, evict)`` for each key of ``needed`` the worker must be sent, with the keys it must
        drop first; a key the task needs is never evicted (the cache grows instead)."""
        sends = []
        for key in needed.values():
            if key in self._keys:
                self._keys.move_to_end(key)
                continue
            evict = []
            while len(self._keys) >= self.capacity:
                old = next((k for k in self._keys if k not in needed.values()), None)
                if old is None:
                    break
                del self._keys[old]
                evict.append(old)
            self._keys[key] = None
            sends.append((key, evict))
        return sends
