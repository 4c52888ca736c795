#!/usr/bin/env bash
# Issue 7 on the lent GPU machine: ddpkit bench ddp (GPT-2-small-like, bf16, batch 8 per GPU) on
# 1 and all GPUs with Accelerate and Fabric interleaved, then the DDP-option candidates.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
N=$(nvidia-smi -L | wc -l)
python3 -m ddpkit bench ddp --model gpt --gpus "1,$N" --batch 8 --steps 20 --frameworks \
  --json "$OUT/ddp_gpt.json" --plot "$OUT/ddp_gpt.png" 2>&1 | tee "$OUT/ddp_gpt.txt" | grep -v "^ddpkit: run"
timeout 400 python3 benchmarks/ddp_defaults.py --model gpt --steps 20 --batch 8 --ranks "1,$N" 2>&1 | tee "$OUT/ddp_defaults.txt"
