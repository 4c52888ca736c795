# a tiny character-level run, CPU-sized
batch_size = 8
block_size = 16
max_iters = 6
log_interval = 1
device = "cpu"
backend = "gloo"
compile = False
