"""Writes the variables it was started with to argv[1]/env-RANK.json, and prints a line."""

import json
import os
import sys
from pathlib import Path

Path(sys.argv[1], f"env-{os.environ['RANK']}.json").write_text(json.dumps(dict(os.environ)))
print(f"hello from rank {os.environ['RANK']}")
print(f"to stderr from rank {os.environ['RANK']}", file=sys.stderr)
