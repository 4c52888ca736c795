#!/usr/bin/env bash
# Issue 7: where GPT scaling crosses 0.97 (batch 16 per GPU, between the 8 and 32 of
# gpu_ddp.sh), and the --compile flag through ddpkit bench ddp.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
N=$(nvidia-smi -L | wc -l)
{
echo "### gpt_b16"
timeout 150 python3 -m ddpkit bench ddp --model gpt --gpus "1,$N" --batch 16 --steps 30 \
  --json "$OUT/ddp_gpt_b16.json" 2>&1 | grep -v "^ddpkit: run"
echo "### gpt_b8_compile"
timeout 200 python3 -m ddpkit bench ddp --model gpt --gpus "1,$N" --batch 8 --steps 30 --compile \
  --json "$OUT/ddp_gpt_b8_compile.json" --plot "$OUT/ddp_gpt_b8_compile.png" 2>&1 \
  | grep -v -e "^ddpkit: run" -e "Profiler record"
} 2>&1 | tee "$OUT/ddp_extra.txt"
