#!/usr/bin/env bash
# Debug: run an NCCL rank that stalls under ddpkit run and show the state folder.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
mkdir -p /tmp/fr && cd /tmp/fr
cat > stall.py <<'PY'
import time, torch, torch.distributed as dist
import ddpkit
s = ddpkit.setup()
for _ in range(3):
    dist.all_reduce(torch.ones(1024, device=s.device))
torch.cuda.synchronize()
print("stall", dist.get_backend(), flush=True)
time.sleep(600)
PY
python3 -m ddpkit run -n 1 --hang-timeout 4 --grace 1 --log-dir /tmp/fr/logs stall.py
ls -la /tmp/fr/logs/*/state0/
python3 - <<'PY'
import threading, sys
sys.path.insert(0, "src")
import torch._C._distributed_c10d as c
print([n for n in dir(c) if "dump" in n.lower()])
PY
