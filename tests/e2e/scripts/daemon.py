"""Starts a daemon that double-forks, drops its environment (env -i) and sleeps, writes its
pid to argv[1], and exits successfully."""

import os
import subprocess
import sys
import time

if os.environ["RANK"] == "0":
    subprocess.Popen(
        ["env", "-i", "sh", "-c", f"sleep 600 & echo $! > {sys.argv[1]}"],
        start_new_session=True,
    ).wait()
    while not os.path.exists(sys.argv[1]) or not open(sys.argv[1]).read().strip():
        time.sleep(0.05)
print("done", flush=True)
