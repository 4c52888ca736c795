"""The launcher behind `ddpkit run`: config -> workers (through a bootstrap) -> supervisor ->
report. Nothing here imports torch at module import time."""
