"""Device arrays (cupy) through the Communicator: every collective, bit for bit
(reductions on the device against the rank-order reduction, on the host
mirrors against the host path), on ranks that share one GPU, with GPU-direct
planes (the planes read device memory from GPU_DIRECT_MIN_BYTES; the job's
sizes fall on both sides) and with pinned host mirrors only. The device steps
themselves run on every CI in tests/test_device_reduction.py (numpy backend).

Skipped with the reason where cupy or a GPU is missing (CI has neither); run on a
GPU machine with ``python -m pytest tests/test_gpu.py``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).resolve().parent / "programs" / "gpu_job.py"


def _gpu_reason():
    try:
        import cupy
    except ImportError:
        return "cupy is not installed (pip install 'mpccs[gpu]')"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "cupy sees no GPU"
    except Exception as exc:  # no driver
        return f"cupy sees no GPU ({type(exc).__name__}: {exc})"
    return None


GPU_REASON = _gpu_reason()
needs_gpu = pytest.mark.skipif(GPU_REASON is not None, reason=GPU_REASON or "")


def test_host_arrays_never_import_cupy():
    # CPU-only installs must not pay cupy's import (or fail on a broken one).
    code = ("import sys, numpy as np, mpccs.comm, mpccs.staging as s;"
            "assert not s.any_on_device(np.ones(2), None);"
            "assert 'cupy' not in sys.modules, 'cupy imported'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


@needs_gpu
@pytest.mark.parametrize("ranks,device_reduce,gpu_direct", [
    (2, "auto", "1"), (3, "auto", "1"), (2, "always", "0"), (3, "always", "0"), (2, "never", "0")],
    ids=["2ranks-gpu-direct", "3ranks-gpu-direct", "2ranks-mirrors-reduced-on-device",
         "3ranks-mirrors-reduced-on-device", "2ranks-mirrors-reduced-on-host"])
def test_every_collective_on_device_arrays_is_bit_exact(ranks, device_reduce, gpu_direct):
    # mirrors: always / never put every size and collective of the job on one path ('auto' picks
    # by size); GPU-direct: the planes read device memory, every reduction on the device
    env = dict(os.environ, MPCCS_TIMEOUT="120", MPCCS_DEVICE_REDUCE=device_reduce, MPCCS_GPU_DIRECT=gpu_direct)
    run = subprocess.run([sys.executable, "-m", "mpccs", "-n", str(ranks), sys.executable, str(JOB)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "GPU_JOB OK" in run.stdout, run.stdout[-4000:]
