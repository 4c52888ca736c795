"""The hang doctor: the watch, each rank's place (stacks, flight recorder), the rank at fault."""
