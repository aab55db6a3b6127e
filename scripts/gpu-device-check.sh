#!/usr/bin/env bash
# The one prepared GPU run (a machine with a GPU and cupy; nothing to install
# from a registry), about 4 minutes: which transports each plane opened, the
# device-array tests (GPU-direct planes and pinned host mirrors), then
# examples/gpu_check.py with cupy arrays and CUDA tensors on GPU-direct planes,
# the same on the mirrors, 4 ranks, and mpccs-perf's all_reduce with buffers
# in GPU memory on both paths (and host buffers with and without the cuda
# transports, for what those cost host arrays). Logs go to $OUT (default
# ./gpu-check-out), at most 8 files. QUICK=1: the tests, the 2-rank check and the
# all_reduce timings only, for a rerun after a fix; HOST=1 adds host arrays on
# the machine's cores (tests/test_cma.py, all_reduce against gloo, 8 B latency,
# bench/cma_ab.py). Wheels for ucxx and its libraries, when
# the machine lacks them, are taken from .whl/ if present.
set -u
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! python3 -c "import ucxx" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 3
    export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
# The image carries an older UCX (1.16) that the dynamic linker finds first: put the wheel's ahead
UCX_WHEEL_LIB=$(python3 -c "import libucx, os; print(os.path.join(os.path.dirname(libucx.__file__), 'lib'))" 2>/dev/null)
[ -n "$UCX_WHEEL_LIB" ] && export LD_LIBRARY_PATH=$UCX_WHEEL_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"; ldconfig -p | grep -E "libucp|libucs\." | head -4
status=0
step() {  # step NAME LOGFILE TIMEOUT COMMAND...: run, append to the log, remember a failure
    local name=$1 log=$2 limit=$3
    shift 3
    echo "### $name ($(date +%T))" | tee -a "$OUT/$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$log"
    local rc=${PIPESTATUS[0]}
    echo "### $name: exit $rc" | tee -a "$OUT/$log"
    [ "$rc" = 0 ] || status=1
}
{
    nvidia-smi -L
    python3 -c "import cupy, numpy, numba; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'numba', numba.__version__)"
    python3 -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())"
    python3 -c "import mpccs.transports.ucx as u; print('ucx', u.ucx_version(), 'ucxx', u.ucxx_version())"
    nproc; uname -r
} 2>&1 | tee "$OUT/env.txt"
step "mpccs-info, GPU-direct" env.txt 60 python3 -m mpccs -n 2 python3 -m mpccs.info
step "mpccs-info, mirrors" env.txt 60 env MPCCS_GPU_DIRECT=0 python3 -m mpccs -n 2 python3 -m mpccs.info
host_steps() {  # HOST=1: host arrays on this machine's cores (cross-memory reads, peers), for the CPU-only paths
    export MPCCS_GPU_DIRECT=0
    step "tests/test_cma.py" host.txt 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cma.py
    local perf="python3 -m mpccs.perf all_reduce -b 1M -e 64M -f 2 -n 20 -w 5 --settle 40 --quiet"
    for k in 1 2; do  # mpccs and gloo alternately, same sizes and timing method
        step "perf all_reduce host memory, adaptive, round $k" host.txt 90 python3 -m mpccs -n 2 $perf
        step "gloo all_reduce, round $k" host.txt 90 python3 -m mpccs -n 2 python3 bench/peers.py gloo \
            -b 1M -e 64M -f 2 -n 20 -w 5
    done
    step "perf all_reduce 8 B latency" host.txt 60 python3 -m mpccs -n 2 python3 -m mpccs.perf all_reduce \
        -b 8 -e 8 -n 2000 -w 100 --quiet --policies up,adaptive
    step "cma_ab all_reduce" host.txt 150 python3 -m mpccs -n 2 --no-prefix python3 bench/cma_ab.py --out "$OUT/cma"
    unset MPCCS_GPU_DIRECT
}
mirror_steps() {  # ONLY=mirror_steps: device arrays on pinned mirrors with and without the reads, and the reads alone
    export MPCCS_GPU_DIRECT=0
    local perf="python3 -m mpccs.perf all_reduce -b 4M -e 64M -f 4 -n 10 -w 3 --quiet"
    for cma in 1 0 1 0; do
        step "perf all_reduce device memory, mirrors, MPCCS_CMA=$cma" mirrors.txt 60 env MPCCS_CMA=$cma \
            python3 -m mpccs -n 2 $perf --memory device --policies up
    done
    for cma in 1 0; do
        step "perf all_reduce host memory in place, MPCCS_CMA=$cma" mirrors.txt 60 env MPCCS_CMA=$cma \
            python3 -m mpccs -n 2 $perf --in-place --policies up
    done
    step "bench/cma_pinned.py" mirrors.txt 120 python3 bench/cma_pinned.py
    unset MPCCS_GPU_DIRECT
}
confirm_steps() {  # ONLY=confirm_steps: device arrays at 64 KiB-64 MiB on each path, and the device tests
    step "tests/test_gpu.py" pytest.txt 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py
    local perf="python3 -m mpccs.perf all_reduce -b 64K -e 64M -f 4 -n 10 -w 3 --quiet --memory device --policies up"
    step "perf all_reduce device memory, GPU-direct from 2 MiB" perf.txt 90 python3 -m mpccs -n 2 $perf
    for cma in 1 0; do
        step "perf all_reduce device memory, mirrors, MPCCS_CMA=$cma" perf.txt 90 env MPCCS_GPU_DIRECT=0 \
            MPCCS_CMA=$cma python3 -m mpccs -n 2 $perf
    done
}
bound_steps() {  # ONLY=bound_steps: GPU-direct against the pinned mirrors at 2-32 MiB, alternating
    # (comm.GPU_DIRECT_MIN_BYTES, GPU_DIRECT_READS_MIN_BYTES)
    local perf="-b 2M -e 32M -f 2 -n 20 -w 3 --quiet --memory device --policies up" collective round
    for run in "all_reduce 1" "all_reduce 2" "reduce_scatter 1" "all_gather 1"; do
        read -r collective round <<< "$run"
        step "perf $collective device memory, GPU-direct, round $round" bound.txt 90 \
            python3 -m mpccs -n 2 python3 -m mpccs.perf $collective $perf
        step "perf $collective device memory, mirrors, round $round" bound.txt 90 env MPCCS_GPU_DIRECT=0 \
            python3 -m mpccs -n 2 python3 -m mpccs.perf $collective $perf
    done
}
profile_steps() {  # ONLY=profile_steps: where a 64 MiB all_reduce on pinned mirrors spends its time, reads on and off
    export MPCCS_GPU_DIRECT=0
    local args="all_reduce -b 64M -e 64M -n 10 -w 3 --quiet --memory device --policies up"
    for cma in 1 0; do
        step "cProfile rank 0, mirrors, 64 MiB, MPCCS_CMA=$cma" profile.txt 90 env MPCCS_CMA=$cma python3 -m mpccs -n 2 \
            sh -c "if [ \$RANK = 0 ]; then exec python3 -m cProfile -o /tmp/prof$cma -m mpccs.perf $args; \
                   else exec python3 -m mpccs.perf $args; fi"
        python3 -c "import pstats; pstats.Stats('/tmp/prof$cma').sort_stats('tottime').print_stats(16)" \
            2>&1 | grep -E "^ +[0-9]|ncalls|function calls" | tee -a "$OUT/profile.txt"
    done
    step "pinned allocations and copies" profile.txt 60 python3 -c "
import cupy, time
for n in (4 << 20, 64 << 20):
    t = time.perf_counter(); m = cupy.cuda.alloc_pinned_memory(n); fresh = time.perf_counter() - t
    del m
    t = time.perf_counter(); m = cupy.cuda.alloc_pinned_memory(n); pooled = time.perf_counter() - t
    t = time.perf_counter(); m2 = cupy.cuda.alloc_pinned_memory(n); held = time.perf_counter() - t
    import numpy as np
    h = np.frombuffer(m, np.uint8, n); d = cupy.ones(n, cupy.uint8); d.get(out=h)
    t = time.perf_counter(); d.get(out=h); d2h = time.perf_counter() - t
    t = time.perf_counter(); d.set(h); cupy.cuda.get_current_stream().synchronize(); h2d = time.perf_counter() - t
    print(f'{n >> 20} MiB: fresh {fresh*1e3:.2f} ms, pooled {pooled*1e3:.3f} ms, another while one held {held*1e3:.2f} ms, d2h {d2h*1e3:.2f} ms, h2d {h2d*1e3:.2f} ms')
"
    unset MPCCS_GPU_DIRECT
}
if [ -n "${ONLY:-}" ]; then  # one named group of steps, e.g. ONLY=mirror_steps
    "$ONLY"
    echo "gpu-device-check ($ONLY): status $status" | tee -a "$OUT/env.txt"
    exit $status
fi
if [ "${QUICK:-0}" = 1 ]; then  # a rerun after a fix: the tests, the check table and the all_reduce timings
    step "tests/test_gpu.py" pytest.txt 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py
    step "gpu_check, 2 ranks, cupy + CUDA tensors" gpu_check.txt 150 \
        python3 examples/gpu_check.py --ranks 2 --sizes 4K,1M,16M,64M --iters 5 --timeout 140
    PERF="python3 -m mpccs.perf all_reduce -b 64K -e 64M -f 4 -n 10 -w 3 --quiet"
    step "perf all_reduce device memory, GPU-direct from 2 MiB" perf.txt 120 \
        python3 -m mpccs -n 2 $PERF --memory device --policies up,adaptive
    step "perf all_reduce device memory, mirrors" perf.txt 120 env MPCCS_GPU_DIRECT=0 \
        python3 -m mpccs -n 2 $PERF --memory device --policies up
    [ "${HOST:-0}" = 1 ] && host_steps
    echo "gpu-device-check (quick): status $status" | tee -a "$OUT/env.txt"
    exit $status
fi
step "tests/test_gpu.py" pytest.txt 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py
SIZES=4K,1M,16M,64M
step "gpu_check GPU-direct, 2 ranks, cupy + CUDA tensors" gpu_check.txt 150 \
    python3 examples/gpu_check.py --ranks 2 --sizes $SIZES --iters 5 --timeout 140
PERF="python3 -m mpccs.perf all_reduce -b 64K -e 64M -f 4 -n 10 -w 3 --quiet"
step "perf all_reduce device memory, GPU-direct, every policy" perf.txt 150 \
    python3 -m mpccs -n 2 $PERF --memory device --compare -J "$OUT/perf_gpu_direct.json"
step "perf all_reduce device memory, mirrors, up" perf.txt 120 env MPCCS_GPU_DIRECT=0 \
    python3 -m mpccs -n 2 $PERF --memory device --policies up
step "gpu_check mirrors, 2 ranks" gpu_check.txt 100 env MPCCS_GPU_DIRECT=0 \
    python3 examples/gpu_check.py --ranks 2 --sizes $SIZES --iters 5 --timeout 90 --no-torch
step "gpu_check GPU-direct, 4 ranks" gpu_check.txt 90 \
    python3 examples/gpu_check.py --ranks 4 --sizes 1M --iters 2 --timeout 80 --no-torch
for backend in mpccs mpccs-pg gloo; do  # DDP on CUDA tensors: the mpccs hook, the mpccs backend, gloo: one loss curve
    step "train_ddp --device cuda --backend $backend" train.txt 90 \
        python3 -m mpccs -n 2 python3 examples/train_ddp.py --device cuda --steps 30 --backend $backend
done
step "perf all_reduce host memory, cuda transports on" perf.txt 60 env MPCCS_GPU_DIRECT=1 \
    python3 -m mpccs -n 2 python3 -m mpccs.perf all_reduce -b 8 -e 1M -f 16 -n 20 -w 5 --quiet --policies up
step "perf all_reduce host memory, cuda transports off" perf.txt 60 env MPCCS_GPU_DIRECT=0 \
    python3 -m mpccs -n 2 python3 -m mpccs.perf all_reduce -b 8 -e 1M -f 16 -n 20 -w 5 --quiet --policies up
echo "gpu-device-check: status $status" | tee -a "$OUT/env.txt"
exit $status
