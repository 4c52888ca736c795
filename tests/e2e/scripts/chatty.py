"""Prints argv[1] lines of 100 bytes as fast as it can (optionally every 10th to stderr), then
'done'. A chatty training loop, in the small."""

import sys

count = int(sys.argv[1])
to_stderr = len(sys.argv) > 2 and sys.argv[2] == "mixed"
line = "x" * 90
for i in range(count):
    out = sys.stderr if to_stderr and i % 10 == 9 else sys.stdout
    print(f"{i:08d} {line}", file=out)
print("done", flush=True)
