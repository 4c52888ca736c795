"""Torch-free code both sides share: the launcher-rank protocol, which frames are library code,
processes, GPU facts (NVML), NCCL's transport log, networks, ranges. No module here imports
torch at import time (tests/unit/test_layout.py pins it)."""
