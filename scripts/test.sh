#!/usr/bin/env bash
# The whole suite, as the README says: install ddpkit with its test extras, lint and type-check,
# run pytest.
# pytest's exit 5 ("no tests ran") is a failure here, as any other non-zero exit.
#
#   bash scripts/test.sh --fast   the inner loop: lint and the unit tests and decision tables
#                                 (tests/unit: no job is started), in about a minute
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
fi
if [ "$fast" = 1 ] && python -c "import ddpkit, pytest, ruff" 2>/dev/null; then
  : # installed already: the inner loop does not reinstall
else
  python -m pip install -q -e '.[test]'
fi
python -m ruff check src tests benchmarks
python -m ruff format --check -q src tests benchmarks
if [ "$fast" = 1 ]; then
  exec python -m pytest -n "${DDPKIT_TEST_WORKERS:-2}" -q tests/unit "$@"
fi
python -m mypy
# the suite starts hundreds of Python processes: let them keep their bytecode (where
# PYTHONDONTWRITEBYTECODE is set, as on CI's machine, each process compiled ddpkit again)
unset PYTHONDONTWRITEBYTECODE
# three workers, one test file each at a time, on 2 cores: the tests wait (timeouts, signals,
# nodes meeting) a quarter of the time, and a third worker fills those waits. On the newest torch
# two workers left 26% of the cores idle (895 s); three, 3% (685 s). DDPKIT_TEST_WORKERS=0 runs
# serially. Starting the longest files first made no difference beyond the spread between runs
# (726 and 784 s against 669 and 805 s in xdist's own order), so xdist's order stays.
python -m pytest -n "${DDPKIT_TEST_WORKERS:-3}" --dist loadfile "$@"
