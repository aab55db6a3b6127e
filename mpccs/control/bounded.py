"""The controller's memories per flow ((src, dst, size class) keys), bounded:
a long run with many sizes and peers must not grow them without end."""
from __future__ import annotations

from typing import Any, Hashable

LIMIT = 4096


def remember(store: dict, key: Hashable, value: Any, limit: int = LIMIT) -> None:
    """``value`` under ``key`` as the most recently used entry; beyond ``limit``
    entries the least recently used one is forgotten."""
    store.pop(key, None)
    store[key] = value
    if len(store) > limit:
        store.pop(next(iter(store)))
