"""Each rank ignores SIGTERM, starts a child that ignores SIGTERM, a child in a session of its
own, and a DataLoader with worker processes; writes every pid to argv[1]/pids-RANK, then waits."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

signal.signal(signal.SIGTERM, signal.SIG_IGN)
out = Path(sys.argv[1])
stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
children = [
    subprocess.Popen([sys.executable, "-c", stubborn]),
    subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    ),
]
loader = torch.utils.data.DataLoader(
    torch.arange(100), num_workers=2, batch_size=1, persistent_workers=True
)
batches = iter(loader)
next(batches)
import psutil  # noqa: E402

mine = [p.pid for p in psutil.Process().children(recursive=True)]
(out / f"pids-{os.environ['RANK']}").write_text(" ".join(map(str, [os.getpid(), *mine])))
print("ready", flush=True)
time.sleep(600)
