"""Shared values (``Pool.share``, e.g. the guidance), sent to each worker once: how the parent
encodes them (``SharedStore``) and its LRU mirror of one worker's cache (``SharedCache``).
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
    """Encodes the shared values of tasks. A task keeps the encodings it needs
    (``TaskHandle.shared_data``), so one lives as long as a task that may still send it (to a
    replacement worker, say) and no count is kept per task."""

    def __init__(self, max_frame: int):
        self.max_frame = max_frame
        self._last: tuple[dict, tuple] = ({}, ({}, {}))  # the last keywords resolved, and how: most tasks share them

    def encode(self, value) -> SharedValue:
        """``value`` encoded and keyed by the hash of its bytes (equal encodings are one value)."""
        data = protocol.encode(value)
        return SharedValue(hashlib.sha256(data).hexdigest()[:16], data)

    def resolve(self, shared: dict) -> tuple[dict[str, str], dict[str, bytes]]:
        """The shared keywords of a task: name -> key, and key -> encoding (a ``SharedValue``
        as it is, any other value encoded)."""
        previous, resolved = self._last
        if previous.keys() == shared.keys() and all(shared[name] is value for name, value in previous.items()):
            return resolved  # the very values of the last task (most tasks share theirs): the same read-only answer
        keys, data = {}, {}
        encoded = False
        for name, value in shared.items():
            if not isinstance(value, SharedValue):
                value, encoded = self.encode(value), True
            if len(value.data) > self.max_frame:
                raise FrameTooLarge(len(value.data), self.max_frame, f"shared value {name!r}")
            keys[name] = value.key
            data[value.key] = value.data
        if not encoded:  # SharedValues only: immutable, so the same objects resolve the same way again
            self._last = (shared, (keys, data))
        return keys, data


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
