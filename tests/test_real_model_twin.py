"""Issue 41: the real model's MLX twin (`macserve dev twin` of SmolLM2-135M-Instruct's GGUF) on
mlx_lm.server as a macserve service, and the KV cache mlx-lm allocates for it against
`inspect`'s figure.

mlx_lm.server (0.32.2) gets two edges of tests/test_real_model_edges.py wrong, and neither is
macserve's code: a character cut by max_tokens is sent as U+FFFD (as macserve's engine did
before `engine.generate.cut_text`), and a stop string that is not its own token sequence is
stripped from the text while the answer runs on (`make_text_state_machine` adds each stop
word as a self-transition; only `make_stop_sequences`' token-level match ends a generation):
"s Par" turns "The capital of France is Paris." into "The capital of France iis.". The second
is pinned below as an expected failure, strict: an mlx-lm that fixes it fails the mark.
"""

import json

import httpx
import pytest

from .fixtures import cli, free_port, status

HELPFUL = "You are a helpful assistant."
FRANCE = "What is the capital of France?"


@pytest.fixture
def macserve_home(home, monkeypatch):
    """fixtures.py's autouse home, overridden: every test here uses the module's."""
    monkeypatch.setenv("MACSERVE_HOME", str(home))
    return home


@pytest.fixture(scope="module")
def twin(home, seen, smollm_twin):
    """`macserve new TWIN` as a user runs it: a folder of safetensors goes to mlx_lm.server."""
    port = free_port()
    r = cli("new", str(smollm_twin), "--name", "twin", "--port", str(port))
    assert r.returncode == 0, r.stderr
    assert "PROVIDER=mlx\n" in (home / "profiles" / "twin.env").read_text()
    seen.append(status("twin")["pid"])
    return f"http://127.0.0.1:{port}"


@pytest.mark.e2e
def test_chat_on_mlx_lm_server_answers_and_ends_its_turn(twin):
    """`macserve chat twin`: Paris, ended by the model's `<|im_end|>` (the twin's eos_token_id),
    not by max_tokens; a name given in the system prompt is the model's answer."""
    r = cli("chat", "twin", FRANCE, "--system", HELPFUL, "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "<|im_end|>" not in r.stdout
    assert "cut at max_tokens" not in r.stderr.strip().splitlines()[-1], r.stderr
    r = cli("chat", "twin", "What is your name?", "--system", "Your name is Zorbo.",
            "--temperature", "0", "--max-tokens", "12")  # fmt: skip
    assert r.returncode == 0 and "Zorbo" in r.stdout, r.stdout + r.stderr


@pytest.mark.e2e
@pytest.mark.xfail(
    strict=True,
    reason="mlx_lm.server 0.32.2 strips a stop string that is not its own token sequence and "
    "runs on ('The capital of France iis.')",
)
def test_a_stop_string_split_across_tokens_on_mlx_lm_server(twin):
    body = {
        "messages": [{"role": "system", "content": HELPFUL}, {"role": "user", "content": FRANCE}],
        "temperature": 0,
        "max_tokens": 12,
    }
    whole = httpx.post(twin + "/v1/chat/completions", json=body, timeout=300).json()
    text = whole["choices"][0]["message"]["content"]
    assert " is Paris" in text, text
    cut = httpx.post(twin + "/v1/chat/completions", json={**body, "stop": ["s Par"]}, timeout=300)
    choice = cut.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (
        text[: text.index("s Par")],
        "stop",
    )


@pytest.mark.model
def test_inspect_counts_the_kv_cache_mlx_lm_allocates_for_the_twin(smollm_twin):
    """A real prefill of the twin in mlx-lm: its KV cache per allocated row is inspect's mlx
    figure for the folder. The twin's checkpoint is float32 and mlx-lm casts nothing, so its
    cache is float32 on any device: 46,080 B/token, twice llama.cpp/f16's 23,040, and
    inspect's mlx row follows the checkpoint's dtype (sizing/host.py `checkpoint_bytes`)."""
    import mlx.core as mx
    from click.testing import CliRunner
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from macserve.cli import main

    r = CliRunner().invoke(main, ["inspect", str(smollm_twin), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["row_source"]["mlx/bf16"] == "measured"
    per_token = d["kv_bytes_per_token"]["mlx/bf16"]
    assert d["rows_dtype"] == "float32"
    assert per_token == 2 * d["kv_bytes_per_token"]["llama.cpp/f16"]

    model, tokenizer = load(str(smollm_twin))
    caches = make_prompt_cache(model)
    ids = tokenizer.encode("The capital of France is Paris. " * 4)
    mx.eval(model(mx.array([ids]), cache=caches))
    rows = caches[0].keys.shape[2]  # mlx-lm grows its buffers in steps (256 rows)
    assert rows >= len(ids) and all(c.offset == len(ids) for c in caches)
    held = sum(c.keys.nbytes + c.values.nbytes for c in caches)
    dtype = caches[0].keys.dtype
    assert dtype == mx.float32
    assert held == per_token * rows, (held, per_token, rows, dtype)
