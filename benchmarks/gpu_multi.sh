#!/usr/bin/env bash
# Issue 8: the multi-GPU validation run, for any number of GPUs. Two parts, each meant to fit
# one 10-minute device call:
#   bash benchmarks/gpu_multi.sh collectives [COUNTS]   # doctor + every collective, eager and -G
#   bash benchmarks/gpu_multi.sh training               # bench ddp 1,2,4..N + NCCL fault cases
# COUNTS defaults to 2, 4, ... up to all GPUs (e.g. "2 4 8"). Results land in $OUT; the table
# to copy into RESULTS.md is printed last. NVLink multicast stays off (device docs), also in
# every worker ddpkit starts (they inherit this environment).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
N=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}  # GPUS=2 tries the script on CPU processes
SIZES=${SIZES:--b 8 -e 1G -f 2}
counts() { local c=2 out=""; while [ "$c" -le "$N" ]; do out="$out $c"; c=$((c * 2)); done
           case " $out " in *" $N "*) ;; *) out="$out $N";; esac; echo $out; }

collectives() {
  local list=${1:-$(counts)}
  python3 -m ddpkit doctor > "$OUT/doctor.txt" 2>&1; echo "doctor exit $?" >> "$OUT/doctor.txt"
  python3 -m ddpkit doctor --json --no-smoke > "$OUT/doctor.json" 2>/dev/null
  mkdir -p "$OUT/bench"
  for g in $list; do
    for c in all_reduce all_gather reduce_scatter alltoall broadcast sendrecv; do
      # shellcheck disable=SC2086
      timeout 120 python3 -m ddpkit bench "$c" $SIZES -g "$g" --json "$OUT/bench/${c}_g$g.json" \
        --plot "$OUT/bench/${c}_g$g.png" > "$OUT/bench/${c}_g$g.txt" 2>&1 || echo "FAILED $c -g $g"
      # shellcheck disable=SC2086
      timeout 120 python3 -m ddpkit bench "$c" $SIZES -g "$g" -G 20 \
        --json "$OUT/bench/${c}_g${g}_graph.json" > "$OUT/bench/${c}_g${g}_graph.txt" 2>&1 \
        || echo "FAILED $c -g $g -G 20"
    done
  done
  (cd "$OUT" && tar czf bench.tgz bench && rm -rf bench)
  grep -A3 -i "smoke" "$OUT/doctor.txt" | head -6
  python3 - "$OUT/bench.tgz" <<'PY'
import io, json, sys, tarfile
rows = {}
with tarfile.open(sys.argv[1]) as tar:
    for m in tar.getmembers():
        if m.name.endswith(".json"):
            d = json.load(tar.extractfile(m))
            name = m.name.split("/")[-1][:-5]
            big = max(d["rows"], key=lambda r: r["size"])
            place = big["ip"] if big.get("ip") and big["ip"].get("busbw") else big["oop"]
            rows[name] = (big["size"], place["busbw"], d["avg_busbw"])
print(f"{'run':<28} {'largest B':>12} {'busbw GB/s':>11} {'avg busbw':>10}  (in-place; else out)")
for name in sorted(rows):
    size, bw, avg = rows[name]
    print(f"{name:<28} {size:>12} {bw or 0:>11.1f} {avg:>10.2f}")
PY
}

training() {
  local list="1 $(counts)"
  timeout 420 python3 -m ddpkit bench ddp --model "${MODEL:-gpt}" --gpus "${list// /,}" --batch 8 --steps 20 \
    --json "$OUT/ddp_gpt.json" --plot "$OUT/ddp_gpt.png" 2>&1 | grep -v "^ddpkit: run" \
    | tee "$OUT/ddp_gpt.txt"
  timeout 170 python3 -m pytest -m gpu tests/gpu/test_nccl_faults.py -v -s -p no:cacheprovider \
    > "$OUT/faults.txt" 2>&1
  grep -E "PASSED|FAILED|passed|failed|stall to report|crash run|Ctrl\+C mid" "$OUT/faults.txt"
  echo "GPU processes left: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)"
}

case "${1:-}" in
  collectives) collectives "${2:-}" ;;
  training) training ;;
  *) echo "usage: $0 collectives [\"2 4 8\"] | training" >&2; exit 2 ;;
esac
