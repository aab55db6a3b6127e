"""MPCCS_TUNE overrides the tuner; MPCCS_MULTIPATH=0 is exactly the single-plane library."""
import numpy as np
import pytest

from mpccs.comm import _parse_tune
from mpccs.errors import ConfigError
from rankpool import RankPool


def algorithms_used(comm):
    used = {}
    for n in (4, 100_000):
        x = np.ones(n, np.float32)
        comm.all_reduce(x)
        used[n] = (comm.last_stats()["algorithm"], bool((x == comm.size).all()))
    return used


def test_tune_string_forces_the_algorithm():
    pool = RankPool(2, env={"MPCCS_TUNE": "all_reduce:0-64K:tree,all_reduce:64K-inf:rhd:chunk=128K"})
    try:
        for used in pool.run(algorithms_used):
            assert used == {4: ("tree", True), 100_000: ("rhd", True)}
    finally:
        pool.close()


def single_plane_only(comm):
    x = np.ones(1 << 20, np.float32)
    comm.all_reduce(x)
    refused = False
    try:
        comm.set_path_policy(0.5)
    except ValueError:
        refused = True
    return comm.last_stats()["bytes_per_plane"], comm.path_policy, refused


@pytest.mark.parametrize("env", [{"MPCCS_MULTIPATH": "0"}, {"MPCCS_TUNE": "multipath=0"}])
def test_multipath_off_is_the_single_plane_library(env):
    pool = RankPool(2, env=env)
    try:
        for bpp, policy, refused in pool.run(single_plane_only):
            assert bpp["out"] == 0 and bpp["up"] > 0
            assert policy == "up" and refused
    finally:
        pool.close()


def test_bad_tune_strings_name_the_token():
    with pytest.raises(ConfigError, match="MPCCS_TUNE"):
        _parse_tune("all_reduce:0-64K:butterfly")
    with pytest.raises(ConfigError, match="MPCCS_TUNE"):
        _parse_tune("all_reduce:lots:ring")
