#!/usr/bin/env bash
# Installs what the tests need, checks the style (ruff), then runs the tests.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MACSERVE_TEST_DEPS=1 source "$here/scripts/install.sh"
cd "$here"
python3 -m ruff check .
python3 -m ruff format --check .
# Two workers, a test file to each at a time (its module fixtures kept, its order kept), the
# longest files first (tests/slow_files.txt, conftest.py; not xdist's most-tests-first): most
# end-to-end tests wait on processes they started, so two cores run two files at once.
# MACSERVE_TEST_WORKERS=0 runs in one process; the per-file timings: tests/README.md.
# One BLAS thread per process when two workers share the two cores: OpenBLAS's own threads
# (2 per process) then fight the other worker's, and its small LAPACK calls (the gate's 128 x
# 128 eigh) ran 7x slower under load; calibrate and bench kv took 1.8-2.8x less wall time with
# one (measured under load, interleaved; see the commit). The servers the tests start inherit it.
case "${MACSERVE_TEST_WORKERS:-2}" in
0 | 1) ;;
*) export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}" ;;
esac
exec python3 -m pytest -q -n "${MACSERVE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
