"""What every part of the launcher names: the job's configuration, a worker and its output, one
snapshot of the ranks and a rank's place, the one way to wait and to ask a rank; imports nothing
of the launcher above it (its watches, its peers, its loop)."""
