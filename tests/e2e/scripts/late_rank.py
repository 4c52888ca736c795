"""ddpkit.setup(), but rank 1 never gets there."""

import os
import time

import ddpkit

if os.environ["RANK"] == "1":
    time.sleep(600)
ddpkit.setup()
