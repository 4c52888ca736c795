"""Ignores SIGTERM and SIGINT after printing 'ready': only SIGKILL ends it."""

import signal
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(600)
