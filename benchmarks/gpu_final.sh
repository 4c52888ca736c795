#!/usr/bin/env bash
# Issues 4, 5, 6 on the lent GPU machine (any number of GPUs): ddpkit doctor (kept as the
# example in docs/), the GPU tests (flight recorder, 2-GPU NCCL faults), and all_reduce small
# sizes again now that bench workers run without per-call tracking.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m ddpkit doctor > "$OUT/doctor.txt" 2>&1; echo "doctor exit $?" >> "$OUT/doctor.txt"
python3 -m ddpkit doctor --json --no-smoke > "$OUT/doctor.json" 2>&1
head -40 "$OUT/doctor.txt"
python3 -m pytest -m gpu tests/gpu -v -s -p no:cacheprovider 2>&1 > "$OUT/gpu_tests.txt"
grep -E "PASSED|FAILED|passed|failed|stall to report|crash run|Ctrl\+C mid|all gone" "$OUT/gpu_tests.txt" | tail -25
N=$(nvidia-smi -L | wc -l)
python3 -m ddpkit bench all_reduce -b 8 -e 128M -f 4 -g "$N" > "$OUT/bench_eager.txt" 2>&1
python3 -m ddpkit bench all_reduce -b 8 -e 128M -f 4 -g "$N" -G 20 > "$OUT/bench_graph.txt" 2>&1
grep -v "^#  Rank" "$OUT/bench_eager.txt" | grep -E "^ +[0-9]" | head -3
grep -E "^ +[0-9]" "$OUT/bench_graph.txt" | head -3
