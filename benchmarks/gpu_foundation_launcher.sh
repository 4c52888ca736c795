#!/usr/bin/env bash
# Issues 2 and 3 on the lent GPU machine (run from the repo root; results land in $OUT or ./out).
# 1. GPU tests (setup on nccl, wrap identity, example, demo, launcher guarantees with NCCL ranks)
# 2. the CPU suite under the machine's torch/Python (another supported version than CI's)
# 3. ddpkit demo on every GPU, and the launcher benchmark against torchrun
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{ nvidia-smi -L; python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, 'nccl', torch.cuda.nccl.version())"; nproc; } 2>&1 | tee "$OUT/machine.txt"
python3 -m pytest -m gpu tests/gpu -v -s -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" | tail -40
CUDA_VISIBLE_DEVICES= timeout 400 python3 -m pytest tests -q -x -p no:cacheprovider 2>&1 | tee "$OUT/cpu_suite.txt" | tail -5
python3 -m ddpkit demo 2>&1 | tr '\r' '\n' | grep -v '%|' | tee "$OUT/demo.txt"
timeout 300 python3 benchmarks/launch_vs_torchrun.py --runs 5 --exit-runs 10 2>&1 | tee "$OUT/launch.txt" | tail -8
echo "== summary"; grep -E "passed|failed" "$OUT/gpu_tests.txt" "$OUT/cpu_suite.txt" | tail -2; tail -5 "$OUT/launch.txt"
