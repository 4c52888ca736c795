"""Data bundled with ddpkit (see README.md here)."""
