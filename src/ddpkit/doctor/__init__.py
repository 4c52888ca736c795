"""`ddpkit doctor`: facts about the machine, checks with fixes, a script scan, a smoke test."""
