"""A bounded mapping that keeps the entries used most recently: the caches of prepared launches and
passed checks, keyed by the geometry of an engine's arrays, hold the few dozen batch shapes an engine
cycles through and drop the oldest past that, so a long-running server's caches stay small."""

from __future__ import annotations

import collections
from typing import Any, Hashable

_ABSENT = object()

# geometries: more than the batch sizes an engine cycles through, each with its few array forms
GEOMETRIES_KEPT = 64


class RecentlyUsed:
    """At most ``size`` entries; reading or writing one makes it the most recent, and a write past
    ``size`` entries drops the least recent. Not thread-safe: callers that share one hold a lock."""

    def __init__(self, size: int = GEOMETRIES_KEPT) -> None:
        self._size = size
        self._entries: collections.OrderedDict = collections.OrderedDict()

    def get(self, key: Hashable, default: Any = None) -> Any:
        entry = self._entries.get(key, _ABSENT)
        if entry is _ABSENT:
            return default
        self._entries.move_to_end(key)
        return entry

    def __contains__(self, key: Hashable) -> bool:
        return self.get(key, _ABSENT) is not _ABSENT

    def put(self, key: Hashable, entry: Any = None) -> Any:
        """Keep ``entry`` under ``key`` as the most recent; return it."""
        self._entries[key] = entry
        self._entries.move_to_end(key)
        if len(self._entries) > self._size:
            self._entries.popitem(last=False)
        return entry

    def pop(self, key: Hashable) -> bool:
        """Drop ``key``; whether it was there."""
        return self._entries.pop(key, _ABSENT) is not _ABSENT

    def values(self) -> list:
        """The entries, least recent first (none made more recent)."""
        return list(self._entries.values())

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
