"""`ddpkit bench`: nccl-tests from Python (same flags, formulas and table), launched on N ranks
by ddpkit's own launcher."""
