#!/usr/bin/env bash
# Issue 7 on the lent GPU machine: ddpkit bench ddp on 1 and all GPUs -- GPT-2-small-like at
# batch 8 (with Accelerate and Fabric interleaved) and 32 per GPU, ResNet-50-like at 64 -- then
# s.wrap's buffer-broadcast default against DDP's on ResNet (benchmarks/ddp_overhead.py).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
N=$(nvidia-smi -L | wc -l)
bench() {  # label, then bench ddp flags
  label=$1; shift
  echo "### $label"
  timeout 300 python3 -m ddpkit bench ddp --gpus "1,$N" --json "$OUT/ddp_$label.json" "$@" 2>&1 \
    | grep -v "^ddpkit: run"
}
{
bench gpt_b8 --model gpt --batch 8 --steps 40 --frameworks --plot "$OUT/ddp_gpt_b8.png"
bench gpt_b32 --model gpt --batch 32 --steps 15
bench resnet_b64 --model resnet --batch 64 --steps 30 --plot "$OUT/ddp_resnet_b64.png"
echo "### resnet_b64 buffers (wrap: broadcast_buffers=False; b100: the same DDP with True)"
timeout 150 python3 -m ddpkit run -n "$N" --hang-timeout 0 benchmarks/ddp_overhead.py --no-profile \
  --model resnet --batch 64 --steps 30 --variants bare,nocomm,b100,wrap,raw 2>&1 \
  | grep -v -e USDT -e "^ddpkit: run" -e "^\[rank 1\]" | sed 's/^\[rank 0\] //'
} 2>&1 | tee "$OUT/ddp.txt"
(cd "$OUT" && tar czf ddp_json.tgz ddp_*.json ddp_overhead_*.json && rm -f ddp_*.json ddp_overhead_*.json)
