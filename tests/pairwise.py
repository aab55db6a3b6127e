"""All-pairs (pairwise) covering arrays: every pair of values of any two
dimensions appears in at least one case, in far fewer cases than the full
product. Deterministic: the same dimensions always give the same cases."""
from __future__ import annotations

import itertools


def all_pairs(dims: dict[str, list], valid=lambda case: True) -> list[dict]:
    names = list(dims)
    uncovered = {
        (a, va, b, vb)
        for a, b in itertools.combinations(names, 2)
        for va in range(len(dims[a]))
        for vb in range(len(dims[b]))
    }
    # pairs that no valid case can cover are dropped up front
    cases: list[dict] = []
    while uncovered:
        best, best_gain = None, 0
        seed = min(uncovered)
        a, va, b, vb = seed
        candidate = {a: va, b: vb}
        for name in names:
            if name in candidate:
                continue
            scores = []
            for v in range(len(dims[name])):
                trial = dict(candidate, **{name: v})
                gain = sum(1 for (x, vx, y, vy) in uncovered
                           if trial.get(x) == vx and trial.get(y) == vy)
                scores.append((gain, -v, v))
            for _, _, v in sorted(scores, reverse=True):
                trial = dict(candidate, **{name: v})
                if _valid_partial(trial, dims, names, valid):
                    candidate = trial
                    break
            else:
                candidate = None
                break
        if candidate is not None and valid({n: dims[n][candidate[n]] for n in names}):
            best = candidate
            best_gain = sum(1 for (x, vx, y, vy) in uncovered if best[x] == vx and best[y] == vy)
        if not best_gain:
            uncovered.discard(seed)
            continue
        uncovered = {(x, vx, y, vy) for (x, vx, y, vy) in uncovered if not (best[x] == vx and best[y] == vy)}
        cases.append({n: dims[n][best[n]] for n in names})
    return cases


def _valid_partial(trial, dims, names, valid) -> bool:
    """A partial assignment is kept if some completion of it is valid (checked greedily)."""
    full = dict(trial)
    for name in names:
        if name not in full:
            for v in range(len(dims[name])):
                probe = dict(full, **{name: v})
                if _check(probe, dims, names, valid, partial=True):
                    full = probe
                    break
            else:
                return False
    return valid({n: dims[n][full[n]] for n in names})


def _check(assign, dims, names, valid, partial):
    if len(assign) < len(names):
        return True
    return valid({n: dims[n][assign[n]] for n in names})
