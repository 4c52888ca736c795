"""The library a training script imports (`ddpkit.setup()` and the session's helpers): the
torch side of ddpkit."""
