"""What the nodes of one job say to each other: meeting (torch elastic's rendezvous), the job's
store and its keys, liveness, aborts, the end. A job of one node has no peers (`NoPeers`)."""
