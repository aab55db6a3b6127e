"""The soak in short (bench/soak.py; the 2000-operation run is in docs/reliability.md):
random collectives, sizes, dtypes, ops and policies with scale-out failures
injected mid-operation. Zero wrong results, zero errors or hangs, failovers
that happened and planes that came back, bounded memory."""
import json
import os
import subprocess
import sys

import pytest

SOAK = os.path.join(os.path.dirname(__file__), "..", "bench", "soak.py")


@pytest.mark.parametrize("ranks,seed,extra_env,extra_args", [
    (2, 3, {}, []),
    (3, 4, {}, []),
    # Borrowed chunks on 'out' paced by the QoS rate cap, through failovers and rejoins.
    (2, 5, {"MPCCS_OUT_CAP_RATE": "200mbit"}, []),
    # In-place all_reduce only, failed at random points: retries resume over the buffer as left.
    (3, 6, {}, ["--focus", "resume", "--late-ms", "5", "--reprobe", "0.2"]),
], ids=["2ranks", "3ranks", "2ranks-paced", "3ranks-resume"])
def test_short_soak(tmp_path, ranks, seed, extra_env, extra_args):
    out = tmp_path / "soak.json"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_", "MPCCS_"))}
    env.update(extra_env)
    resume = "resume" in extra_args
    p = subprocess.run([sys.executable, SOAK, "-n", str(ranks), "--ops", "200", "--seed", str(seed),
                        "--fail-rate", "0.3" if resume else "0.08", "--json", str(out), *extra_args],
                       capture_output=True, text=True, timeout=300, env=env)
    summaries = json.loads(out.read_text()) if out.exists() else []
    assert len(summaries) == ranks, p.stdout[-3000:] + p.stderr[-2000:]
    for s in summaries:
        assert s["wrong"] == [] and s["errors"] == [], s
        assert s["failovers"] >= 1 and s["rejoins"] >= 1, s  # failures were injected and survived
        if resume:
            assert s["resumed_in_place"] >= 3, s
        # 200 operations are too few for a leak figure (the 2000-op run checks <10%); this only
        # catches a gross one, e.g. a buffer per operation kept alive.
        assert s["rss_growth"] < 0.5, json.dumps(s)  # (whole: pytest cuts a dict's repr short)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]


def test_a_wrong_result_is_reported_with_where_it_differs():
    # A soak failure may not recur: the report says which elements differ.
    import importlib.util

    import numpy as np
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    expected = np.arange(1, 11, dtype=np.int32)
    got = expected.copy()
    got[3:5] = 0
    got[8] = 7
    assert soak.mismatch(got, expected) == {"elements": 3, "of": 10, "ranges": [[3, 5], [8, 9]],
                                            "first": {"got": 0, "expected": 4}}
    assert soak.mismatch(expected, expected)["elements"] == 0
