"""Rank 0 "downloads" for argv[1] seconds (a child process writing a file, as a data
preparation step) while rank 1 waits at a barrier; then both go on."""

import os
import subprocess
import sys

import torch.distributed as dist

dist.init_process_group("gloo")
print("stall", flush=True)
if dist.get_rank() == 0:
    writer = (
        "import sys, time\n"
        "end = time.time() + float(sys.argv[1])\n"
        "with open(sys.argv[2], 'wb') as f:\n"
        "    while time.time() < end:\n"
        "        f.write(b'x' * 2**20); f.flush(); time.sleep(0.05)\n"
    )
    target = os.path.join(sys.argv[2], "dataset.bin")
    subprocess.run([sys.executable, "-c", writer, sys.argv[1], target], check=True)
dist.barrier()
print("finished", flush=True)
