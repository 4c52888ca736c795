"""What runs inside each worker that `ddpkit run` starts: the bootstrap (death signal, stack
dumps, error records, the user's script), the progress record and the flight-recorder server.
It talks to the launcher only through `ddpkit.common.protocol`."""
