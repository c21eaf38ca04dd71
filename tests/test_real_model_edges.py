"""Issue 41, item 5: the real model's tokenizer and template at their edges, through macserve's
path: a router in front of two profiles of SmolLM2-135M-Instruct at CTX=256, `smol` (its GGUF
on llama-server) and `eng` (its MLX twin on macserve's own engine). Each edge is asked of both,
by the profile's name, through the router (which rewrites every streamed line's model name).

- multi-byte text (Chinese, an emoji) streams in whole characters: every SSE line is valid
  UTF-8 on its own, no delta carries U+FFFD, and the deltas add up to the non-streamed answer;
- max_tokens inside a character (🍕 is 3 tokens) sends none of it, and inside a word
  ("Photosynthesis" is "Photos" + "ynthesis") sends the cut word's first part;
- a stop string split across tokens ("s Par" across " is" and " Paris") ends the answer
  before it, streamed or not;
- an empty system message is one (the template then leaves out its default system line);
- a prompt that fills the context with max_tokens is answered; one over it gets a clear 400.

What the servers do wrong, and where it was fixed: macserve's engine sent a character cut by
max_tokens as U+FFFD (mlx-lm's detokenizer's `finalize`): fixed here (`engine.generate.cut_text`).
llama-server's non-streamed answer still ends such a cut with U+FFFD while its stream leaves it
out (pinned below: a llama.cpp upgrade that changes it shows here). mlx_lm.server (0.32.2) has
the U+FFFD cut too and mishandles a stop string that is not its own token sequence (it strips
the string and runs on): tests/test_real_model_twin.py.

The 8K edge: a prompt over the model's own 8,192 is refused in tests/test_real_model.py. A 7K
prompt near it is left to a person: its prefill is the cost (on this 2-core machine at load
8-9, llama-server -t 1 answered 6,473 prompt tokens in 184 s, 35 tokens/s), more than all of
these tests together; at CTX=256 the same edge costs 248 tokens.
"""

import json
import re

import httpx
import pytest

from .fixtures import cli, free_port, need_llama_server, router_process, status

pytestmark = pytest.mark.e2e

CTX = 256  # the smallest context that holds every edge: each prefill is short
PROFILES = ("smol", "eng")
HELPFUL = {"role": "system", "content": "You are a helpful assistant."}
FRANCE = {"role": "user", "content": "What is the capital of France?"}
PIZZA = [HELPFUL, {"role": "user", "content": "What does 🍕 mean?"}]
CAT = [HELPFUL, {"role": "user", "content": "Write the word cat in Chinese characters."}]


@pytest.fixture
def macserve_home(home, monkeypatch):
    """fixtures.py's autouse home, overridden: every test here uses the module's."""
    monkeypatch.setenv("MACSERVE_HOME", str(home))
    return home


@pytest.fixture(scope="module")
def router(home, seen, smollm_gguf, smollm_twin):
    """The two profiles, started by `new`, and a router in front of them."""
    need_llama_server()
    ports = {n: free_port() for n in PROFILES}
    for name, args in (
        ("smol", [str(smollm_gguf), "--extra-args", "-t 1"]),
        ("eng", [str(smollm_twin), "--provider", "macserve"]),
    ):
        r = cli("new", *args, "--name", name, "--ctx", str(CTX), "--port", str(ports[name]))
        assert r.returncode == 0, r.stderr
        seen.append(status(name)["pid"])
    port = free_port()
    with router_process(home, ["router", "--port", str(port), "--ttl", "600s"], port) as r:
        r.smol = f"http://127.0.0.1:{ports['smol']}"  # llama-server itself, for /tokenize
        yield r


def post(url, model, messages, **more) -> httpx.Response:
    body = {"model": model, "messages": messages, "temperature": 0, **more}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=300)


def ask(url, model, messages, **more) -> dict:
    r = post(url, model, messages, **more)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["model"] == model  # the router's rename
    return d


def text(d: dict) -> str:
    return d["choices"][0]["message"]["content"]


def streamed(url, model, messages, **more) -> tuple[list[str], str | None]:
    """The deltas and the finish reason of a streamed answer, each SSE line decoded from its
    own bytes (a character split between two events would fail to decode here)."""
    body = {"model": model, "messages": messages, "temperature": 0, "stream": True, **more}
    deltas, finish, buf = [], None, b""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for chunk in r.iter_bytes():
            *lines, buf = (buf + chunk).split(b"\n")
            for line in lines:
                if line.startswith(b"data: {"):
                    event = json.loads(line[6:].decode("utf-8"))
                    choice = (event.get("choices") or [{}])[0]
                    if piece := (choice.get("delta") or {}).get("content"):
                        deltas.append(piece)
                    finish = choice.get("finish_reason") or finish
    return deltas, finish


@pytest.mark.parametrize("model", PROFILES)
def test_chinese_and_an_emoji_stream_as_whole_characters(router, model):
    for messages, char in ((CAT, "猫"), (PIZZA, "🍕")):
        whole = text(ask(router.url, model, messages, max_tokens=6))
        deltas, finish = streamed(router.url, model, messages, max_tokens=6)
        assert char in whole and "\ufffd" not in whole, whole
        assert not [d for d in deltas if "\ufffd" in d], deltas
        assert "".join(deltas) == whole and finish == "length"


@pytest.mark.parametrize("model", PROFILES)
def test_max_tokens_inside_a_character_or_a_word(router, model):
    """🍕 is three tokens: cut after one or two, no part of it is sent (streamed), and the
    third completes it. "Photosynthesis" begins "Photos" + "ynthesis": one token is "Photos"."""
    for n in (1, 2):
        deltas, finish = streamed(router.url, model, PIZZA, max_tokens=n)
        assert (deltas, finish) == ([], "length"), deltas
        d = ask(router.url, model, PIZZA, max_tokens=n)
        assert d["usage"]["completion_tokens"] == n
        # llama-server's non-streamed answer ends the cut character with U+FFFD (its stream
        # does not): llama.cpp's, not ours; the engine leaves it out in both
        assert text(d) == {"smol": "\ufffd", "eng": ""}[model], text(d)
    assert streamed(router.url, model, PIZZA, max_tokens=3) == (["🍕"], "length")
    photo = [HELPFUL, {"role": "user", "content": "What is photosynthesis?"}]
    d = ask(router.url, model, photo, max_tokens=1)
    assert (text(d), d["choices"][0]["finish_reason"]) == ("Photos", "length")


@pytest.mark.parametrize("model", PROFILES)
def test_a_stop_string_split_across_tokens(router, model):
    """ "s Par" spans two tokens of the answer (" is", " Paris"): the answer ends before it."""
    pieces = httpx.post(router.smol + "/tokenize", timeout=30,
                        json={"content": " is Paris", "with_pieces": True}).json()["tokens"]  # fmt: skip
    assert [p["piece"] for p in pieces] == [" is", " Paris"]
    whole = text(ask(router.url, model, [HELPFUL, FRANCE], max_tokens=12))
    assert " is Paris" in whole, whole
    want = whole[: whole.index("s Par")]
    d = ask(router.url, model, [HELPFUL, FRANCE], max_tokens=12, stop=["s Par"])
    assert (text(d), d["choices"][0]["finish_reason"]) == (want, "stop")
    deltas, finish = streamed(router.url, model, [HELPFUL, FRANCE], max_tokens=12, stop=["s Par"])
    assert ("".join(deltas), finish) == (want, "stop")


@pytest.mark.parametrize("model", PROFILES)
def test_an_empty_system_message(router, model):
    """Rendered as an empty system turn: the template's default system line is left out (fewer
    prompt tokens than with no system message at all), and the answer is still Paris."""
    empty = ask(router.url, model, [{"role": "system", "content": ""}, FRANCE], max_tokens=12)
    none = ask(router.url, model, [FRANCE], max_tokens=1)
    assert "Paris" in text(empty)
    assert empty["usage"]["prompt_tokens"] < none["usage"]["prompt_tokens"]


def prompt_of(router, n: int) -> list[dict]:
    """Messages whose rendered prompt is exactly `n` tokens (llama-server's tokenizer, which the
    twin's tokenizer.json was rebuilt from; usage.prompt_tokens confirms it on each)."""
    para = "The quick brown fox jumps over the lazy dog near the river bank. "

    def msgs(k):
        return [HELPFUL, {"role": "user", "content": "fox " * k + para * 12 + "Who jumps?"}]

    def count(k):
        p = httpx.post(router.smol + "/apply-template", json={"messages": msgs(k)}, timeout=30)
        ids = httpx.post(router.smol + "/tokenize", timeout=30,
                         json={"content": p.json()["prompt"], "parse_special": True})  # fmt: skip
        return len(ids.json()["tokens"])

    k = n - count(0)
    assert k >= 0 and count(k) == n, (n, count(0))
    return msgs(k)


@pytest.mark.parametrize("model", PROFILES)
def test_a_prompt_that_fills_the_context_and_one_over(router, model):
    """248 prompt tokens + max_tokens 8 = the whole context of 256: answered. 262: a 400 that
    names both figures (each server's own wording), computed by neither."""
    d = ask(router.url, model, prompt_of(router, CTX - 8), max_tokens=8)
    assert d["usage"]["prompt_tokens"] == CTX - 8
    assert 1 <= d["usage"]["completion_tokens"] <= 8
    r = post(router.url, model, prompt_of(router, CTX + 6), max_tokens=8)
    assert r.status_code == 400, r.text
    said = r.json()["error"]["message"]
    assert re.search(rf"\b{CTX + 6}\b.*\b{CTX}\b", said), said
