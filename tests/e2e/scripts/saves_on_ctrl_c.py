"""A training loop that saves its state when interrupted (except KeyboardInterrupt) and says
goodbye in finally, as many training scripts do."""

import os
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
rank = os.environ["RANK"]
step = 0
try:
    print("training", flush=True)
    while True:
        step += 1
        time.sleep(0.05)
except KeyboardInterrupt:
    (out / f"saved-{rank}").write_text(str(step))
    print(f"rank {rank} saved at step {step}", flush=True)
    raise
finally:
    (out / f"finally-{rank}").write_text("1")
