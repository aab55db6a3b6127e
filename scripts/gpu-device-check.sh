#!/usr/bin/env bash
# The one prepared GPU run (a machine with a GPU and cupy; nothing to install
# from a registry): the device-array tests, then examples/gpu_check.py with
# cupy arrays and CUDA tensors (reductions on the device, then on the host
# mirrors), the same flow on numpy arrays for the staging overhead, 4 ranks, and
# bench/gpu_reduce.py (the three reduction paths timed side by side). Logs go to $OUT (default ./gpu-check-out). Wheels for ucxx and its
# libraries, when the machine lacks them, are taken from .whl/ if present.
set -u
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! python3 -c "import ucxx" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 3
    export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
{
    nvidia-smi -L
    python3 -c "import cupy, numpy, numba; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'numba', numba.__version__)"
    python3 -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())"
    python3 -c "import mpccs.transports.ucx as u; print('ucx', u.ucx_version(), 'ucxx', u.ucxx_version())"
} 2>&1 | tee "$OUT/env.txt"
status=0
timeout 240 python3 -m pytest -q -x -p no:cacheprovider -rs tests/test_gpu.py 2>&1 | tee "$OUT/pytest.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
# reductions on the device (default), then on the host mirrors, then numpy arrays (no device at all)
timeout 150 python3 examples/gpu_check.py --ranks 2 --sizes 4K,1M,16M,64M --iters 5 --timeout 140 2>&1 \
    | tee "$OUT/gpu_check_cupy.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
MPCCS_DEVICE_REDUCE=never timeout 100 python3 examples/gpu_check.py --ranks 2 --sizes 4K,1M,16M,64M --iters 5 \
    --timeout 90 --no-torch 2>&1 | tee "$OUT/gpu_check_cupy_host_reduce.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
timeout 100 python3 examples/gpu_check.py --ranks 2 --sizes 4K,1M,16M,64M --iters 5 --timeout 90 --simulate-cpu \
    --no-torch 2>&1 | tee "$OUT/gpu_check_host.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
timeout 90 python3 examples/gpu_check.py --ranks 4 --sizes 1M --iters 2 --timeout 80 --no-torch 2>&1 \
    | tee "$OUT/gpu_check_cupy_4ranks.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
# reductions of cupy arrays: on the device, on the mirrors, numpy arrays, interleaved
timeout 240 python3 -m mpccs -n 2 python3 bench/gpu_reduce.py --out "$OUT/gpu_reduce" 2>&1 | tee "$OUT/gpu_reduce.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
exit $status
