"""bench/matrix.py's convergence analysis against the fixed-fraction sweep, on
synthetic series files (the testbed runs themselves are benchmarks, not tests)."""
import importlib.util
import json
import os

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "bench", "matrix.py")


@pytest.fixture(scope="module")
def matrix():
    spec = importlib.util.spec_from_file_location("matrix_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


T_ON, T_OFF = 100.0, 200.0  # the background's first and last byte (wall seconds)


def write_series(raw, name, ops_by_rank, policy):
    base = os.path.join(raw, "series", name)
    os.makedirs(os.path.dirname(base), exist_ok=True)
    run = {"name": name, "policy": policy, "kind": "background", "env": {},
           "events": [{"wall": T_ON - 0.1, "event": "background_start"}, {"wall": T_OFF + 0.05, "event": "background_stop"}],
           "background": [{"first_byte": T_ON, "last_byte": T_OFF}]}
    with open(f"{base}.run.json", "w") as fh:
        json.dump(run, fh)
    for rank, ops in enumerate(ops_by_rank):
        with open(f"{base}.ops.rank{rank}.json", "w") as fh:
            json.dump({"rank": rank, "ops": ops}, fh)


def op(t, dt, share_up, policy="adaptive"):
    nbytes = 16 << 20
    up = int(nbytes * share_up)
    return {"t": t, "dt": dt, "bytes_per_plane": {"up": up, "out": nbytes - up}, "policy": policy}


def sweep_time(fraction, loaded):
    """Operation time of a fixed fraction: best at 0.7 idle, at 0.8 under load."""
    best = 0.8 if loaded else 0.7
    return 0.1 + abs(fraction - best)


def test_the_sweep_finds_the_best_fraction_per_load_and_convergence_is_counted_from_the_first_byte(tmp_path, matrix):
    raw = str(tmp_path)
    fractions = matrix.SWEEP_FRACTIONS
    ops = []
    t, i = 0.0, 0
    while t < 300:
        f = fractions[i % len(fractions)]
        ops.append(op(t, sweep_time(f, T_ON <= t < T_OFF), f, policy=str(f)))
        t += 0.25
        i += 1
    write_series(raw, "background_sweep", [ops, ops], "sweep:" + ",".join(map(str, fractions)))
    sweep = matrix.analyse_sweep(raw)
    assert sweep["segments"]["start"]["best"] == 0.7
    assert sweep["segments"]["background on"]["best"] == 0.8
    assert sweep["segments"]["background off"]["best"] == 0.7

    # 'adaptive': rank 1 (its 'out' crosses the loaded link) moves to 0.81 two operations after the
    # load starts; rank 0 stays at 0.7. One operation started between the testbed's start event and the
    # first byte: it is not under load and must not count.
    def shares(rank, t):
        if t < T_ON or t >= T_OFF:
            return 0.7
        k = int((t - T_ON) / 0.25)  # operations since the first byte
        return 0.7 if rank == 0 else (0.7, 0.7, 0.81)[min(k, 2)]
    per_rank = []
    for rank in (0, 1):
        # (one operation starts at 99.95: after the start event, before the first byte)
        per_rank.append([op(t, 0.11, shares(rank, t)) for t in [x * 0.25 + 0.2 for x in range(1200)]])
    write_series(raw, "background", per_rank, "adaptive")
    res = matrix.converge_to_sweep(raw, "background", sweep)
    on = res["background on"]
    assert on["best_fixed"] == 0.8
    assert on["shares"]["rank 1"]["first"][:4] == [0.7, 0.7, 0.81, 0.81]
    # the 5-operation mean within 5 points of 0.8: (0.7 + 0.7 + 0.81) / 3 = 0.737 not yet, + 0.81 -> 0.755
    assert on["shares"]["rank 1"]["first_ops"] == 3
    assert on["shares"]["rank 0"]["first_ops"] is None  # rank 0 keeps its own split, 10 points off
    assert on["median_op_ms"] == pytest.approx(110.0)
    assert on["time_vs_best_fixed"] == pytest.approx(100.0 / 110.0)
    off = res["background off"]
    assert off["best_fixed"] == 0.7 and off["shares"]["all"]["first_ops"] == 0

    text = "\n".join(matrix.sweep_lines(sweep, res and {"background": res}))
    assert "| 0.8 |" in text and "**100**" in text  # the best fraction is marked in the table
    assert "rank 1 3 ops" in text


def test_planned_share_sums_the_ranks_own_decisions(matrix):
    """The share planned for a rank's own flows, from its stages' decision records (not the bytes that moved)."""
    stage = lambda up, out, other_up: {"split": {"ranks": {"1": {"bytes": {"up": up, "out": out}},  # noqa: E731
                                                           "0": {"bytes": {"up": other_up, "out": 0}}}}}
    record = {"rank": 1, "stages": [stage(3, 1, 9), stage(5, 3, 9)]}
    assert matrix.planned_share(record) == pytest.approx(8 / 12)
    assert matrix.planned_share({"rank": 0, "stages": [{"split": {}}]}) is None  # a fixed policy decides nothing


def test_planned_spread_counts_reversals_in_the_second_half(matrix):
    steady = [0.9] * 4 + [0.7, 0.7, 0.705, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7]
    saw = [0.9] * 10 + [0.73, 0.76, 0.80, 0.73, 0.76, 0.80, 0.73, 0.76, 0.80, 0.73]
    calm, swinging = matrix.planned_spread(steady), matrix.planned_spread(saw)
    assert calm["reversals"] == 0 and calm["p90"] - calm["p10"] < 0.01
    assert swinging["reversals"] >= 3 and swinging["p90"] - swinging["p10"] > 0.05
    assert matrix.planned_spread([0.5, 0.6]) is None  # too short to say
