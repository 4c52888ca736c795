#!/usr/bin/env bash
# The whole suite, as the README says: install ddpkit with its test extras, lint and type-check,
# run pytest.
# pytest's exit 5 ("no tests ran") is a failure here, as any other non-zero exit.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e '.[test]'
python -m ruff check src tests benchmarks
python -m ruff format --check -q src tests benchmarks
python -m mypy
# the suite starts hundreds of Python processes: let them keep their bytecode (where
# PYTHONDONTWRITEBYTECODE is set, as on CI's machine, each process compiled ddpkit again)
unset PYTHONDONTWRITEBYTECODE
# two workers, one test file each at a time: 12.5 min serial became 8.5 min on 2 cores (torch
# 2.13 CPU). DDPKIT_TEST_WORKERS=0 runs serially.
python -m pytest -n "${DDPKIT_TEST_WORKERS:-2}" --dist loadfile "$@"
