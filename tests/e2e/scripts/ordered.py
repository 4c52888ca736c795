"""stdout and stderr, one after the other, then an uncaught error: the traceback must come
after every line printed before it."""

import sys

for i in range(200):
    print(f"out {i}")
    print(f"err {i}", file=sys.stderr)
print("last line before the error")
raise RuntimeError("the end")
