#!/usr/bin/env bash
# Issue 7, scaling: where DDP's step time goes (benchmarks/ddp_overhead.py) on 1 and all GPUs,
# then the 2-rank case again under NCCL/stream settings that change how communication overlaps.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
N=$(nvidia-smi -L | wc -l)
run() {  # label, ranks, env..., then script args after --
  label=$1; n=$2; shift 2
  envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  echo "### $label"
  env "${envs[@]}" timeout 300 python3 -m ddpkit run -n "$n" --hang-timeout 0 \
    benchmarks/ddp_overhead.py "$@" 2>&1 | grep -v -e USDT -e "^ddpkit: run" | sed 's/^\[rank 0\] //'
  [ -f "$OUT/ddp_overhead_$n.json" ] && mv "$OUT/ddp_overhead_$n.json" "$OUT/ddp_overhead_${label}.json"
}
{
nproc; lscpu | grep -i -e numa -e "model name" -e "^CPU(s)"; nvidia-smi topo -m
grep -s Cpus_allowed_list /proc/self/status
nvidia-smi --query-gpu=index,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 500 > "$OUT/clocks.csv" & SAMPLER=$!
V=bare,nocomm,wrap,raw,b400
run r1 1 X=1 -- --steps 40 --variants bare,raw --no-profile
run r1_gcoff 1 X=1 -- --steps 40 --variants bare,raw --no-profile --gc-off
run r1_b32 1 X=1 -- --steps 20 --variants bare,raw --batch 32
if [ "$N" -ge 2 ]; then
  run r$N "$N" X=1 -- --steps 40 --variants $V --no-profile
  run r${N}_gcoff "$N" X=1 -- --steps 40 --variants $V --no-profile --gc-off
  run r${N}_b32 "$N" X=1 -- --steps 20 --variants $V --batch 32
fi
run r1_compile 1 X=1 -- --steps 30 --variants bare --no-profile --compile
[ "$N" -ge 2 ] && run r${N}_compile "$N" X=1 -- --steps 30 --variants bare,wrap --no-profile --compile
kill $SAMPLER
} 2>&1 | grep -v -e UserWarning -e _warn_once | tee "$OUT/ddp_overhead.txt"
(cd "$OUT" && tar czf ddp_overhead_json.tgz ddp_overhead_*.json && rm -f ddp_overhead_*.json)
