#!/usr/bin/env bash
# Issue 7: which bucket_cap_mb should s.wrap default to? Every size in the same 2-rank job,
# interleaved (benchmarks/ddp_overhead.py), for GPT at batch 8 (twice: repeatability) and 32,
# ResNet-50 at batch 64, and GPT under torch.compile.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
N=$(nvidia-smi -L | wc -l)
run() {  # label, seconds, script args
  label=$1; limit=$2; shift 2
  echo "### $label"
  timeout "$limit" python3 -m ddpkit run -n "$N" --hang-timeout 0 benchmarks/ddp_overhead.py \
    --no-profile "$@" 2>&1 | grep -v -e USDT -e "^ddpkit: run" -e UserWarning -e _warn_once \
    | sed 's/^\[rank 0\] //'
  [ -f "$OUT/ddp_overhead_$N.json" ] && mv "$OUT/ddp_overhead_$N.json" "$OUT/buckets_${label}.json"
}
V=bare,nocomm,b25,b50,b100,b200,b400,b1000
{
run gpt_b8_a 120 --steps 60 --variants $V
run gpt_b8_b 120 --steps 60 --variants $V
run gpt_b32 120 --steps 20 --batch 32 --variants $V
run resnet_b64 150 --model resnet --steps 30 --batch 64 --variants $V
run gpt_b8_compile 240 --steps 20 --compile --variants bare,b25,b100,b400
} 2>&1 | tee "$OUT/ddp_buckets.txt"
(cd "$OUT" && tar czf ddp_buckets_json.tgz buckets_*.json && rm -f buckets_*.json)
