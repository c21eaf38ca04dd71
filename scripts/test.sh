#!/usr/bin/env bash
# Installs what the tests need, then runs them all.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$here/scripts/install.sh"
cd "$here"
exec python3 -m pytest -q "$@"
