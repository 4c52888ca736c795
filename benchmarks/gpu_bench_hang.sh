#!/usr/bin/env bash
# Issues 4 and 6 on the lent GPU machine: GPU tests (flight recorder, launcher), then ddpkit bench
# for every collective, eager and -G, on all GPUs; results beside the nccl-tests anchors.
# Needs the anchors copied into benchmarks/anchors/ (shared/ does not travel to the device).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT/bench"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi topo -m 2>&1 | head -8 | tee "$OUT/topo.txt"
python3 -m pytest -m gpu tests/gpu -v -s -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" | grep -E "PASS|FAIL|Error|passed|failed" | tail -15
N=$(nvidia-smi -L | wc -l)
run() {  # name, args...
  local name=$1; shift
  timeout 240 python3 -m ddpkit bench "$@" -g "$N" --json "$OUT/bench/$name.json" > "$OUT/bench/$name.txt" 2> "$OUT/bench/$name.err" || echo "FAILED $name (see $name.err)"
}
for c in all_reduce all_gather reduce_scatter alltoall broadcast reduce sendrecv; do
  run "$c" "$c" -b 8 -e 1G -f 4
  run "${c}_graph" "$c" -b 8 -e 1G -f 4 -G 20
done
run all_reduce_plot all_reduce -b 8 -e 1G -f 2 --plot "$OUT/all_reduce_busbw.png"
cat "$OUT/bench/all_reduce.txt" "$OUT/bench/all_reduce_graph.txt" | grep -v "^#  Rank"
echo "== vs nccl-tests (ratio = ddpkit / nccl-tests)"
python3 benchmarks/bench_vs_nccl_tests.py "$OUT/bench" "benchmarks/anchors/h200x$N" | tee "$OUT/compare.txt"
tar czf "$OUT/bench.tgz" -C "$OUT" bench && rm -rf "$OUT/bench"
