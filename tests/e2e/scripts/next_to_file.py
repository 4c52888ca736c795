"""Opens a file that lives next to the script after changing directory, via __file__."""

import os
import sys

os.chdir("/")
with open(os.path.join(os.path.dirname(__file__), "data.txt")) as f:
    print(f"read {f.read().strip()} argv0={sys.argv[0]} abs={os.path.isabs(__file__)}")
if len(sys.argv) > 1:
    raise ValueError("show me where")
