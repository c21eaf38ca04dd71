#!/usr/bin/env bash
# Installs what the tests need, checks the style (ruff), then runs the tests.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MACSERVE_TEST_DEPS=1 source "$here/scripts/install.sh"
cd "$here"
python3 -m ruff check .
python3 -m ruff format --check .
exec python3 -m pytest -q "$@"
