"""Examples that ship with ddpkit (the demo runs digits)."""
