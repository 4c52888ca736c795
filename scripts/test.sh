#!/usr/bin/env bash
# The whole suite, as the README says: install ddpkit with its test extras, lint, run pytest.
# pytest's exit 5 ("no tests ran") is a failure here, as any other non-zero exit.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e '.[test]'
python -m ruff check src tests benchmarks
python -m pytest "$@"
