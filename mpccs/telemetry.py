"""Per-operation records: JSON lines to ``MPCCS_TRACE`` (one file per rank).

``MPCCS_TRACE=/tmp/trace.jsonl`` writes ``/tmp/trace.jsonl.rank0`` etc.;
``{rank}`` in the path is replaced instead when present. Each line is one
operation's ``stats()`` with a wall-clock timestamp.
"""
from __future__ import annotations

import json
import time
from typing import Optional


class Telemetry:
    def __init__(self, path: Optional[str], rank: int):
        self._file = None
        if path:
            target = path.replace("{rank}", str(rank)) if "{rank}" in path else f"{path}.rank{rank}"
            self._file = open(target, "a", buffering=1 << 16)
        self.rank = rank

    def record(self, stats: dict) -> None:
        if self._file is None:
            return
        line = {"t": time.time(), "rank": self.rank, **stats}
        self._file.write(json.dumps(line, default=_jsonable) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _jsonable(value):
    if hasattr(value, "__dict__"):
        return {k: v for k, v in vars(value).items() if not k.startswith("_")}
    return str(value)
