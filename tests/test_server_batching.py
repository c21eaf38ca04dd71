"""Continuous batching and the prompt cache through a real `macserve serve` subprocess and the
official `openai` and `anthropic` clients: concurrent requests (streaming and not) get the
greedy answers they get alone, none is refused, each keeps its own seed and grammar, a client
that leaves or a stop string ends only its own sequence, and `cached_tokens` counts exactly
the prefix the prompt cache gave (bf16, and INT2 with MTP drafting)."""

import json
import threading
import time

import anthropic
import httpx
import jsonschema
import openai
import pytest

from .serverproc import serve

pytestmark = pytest.mark.e2e

PROMPTS = [
    "Good morrow, sir.",
    "What news from Verona?",
    "Speak, I am bound to hear.",
    "Who's there?",
    "How now, what noise is that?",
    "Tell me, where is fancy bred?",
    "O, what a noble mind is here o'erthrown!",
    "Now is the winter of our discontent.",
]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def _client(s) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _ask(c, i: int, stream: bool, **kw) -> tuple[str, str]:
    body = dict(
        model="m",
        messages=[{"role": "user", "content": PROMPTS[i]}],
        max_tokens=kw.pop("max_tokens", 40),
        temperature=kw.pop("temperature", 0),
        **kw,
    )
    if not stream:
        r = c.chat.completions.create(**body)
        return r.choices[0].message.content, r.choices[0].finish_reason
    chunks = [x for x in c.chat.completions.create(stream=True, **body) if x.choices]
    text = "".join(x.choices[0].delta.content or "" for x in chunks)
    return text, chunks[-1].choices[0].finish_reason


def _together(fn, n: int) -> dict:
    """fn(i) for i < n in n threads at once; {i: result}; fails on any exception."""
    out, errors = {}, []

    def run(i):
        try:
            out[i] = fn(i)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{i}: {e!r}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    assert len(out) == n
    return out


class _Peak:
    """The most sequences /health reported in flight while the block ran."""

    def __init__(self, s):
        self.s, self.peak, self.stop = s, 0, threading.Event()

    def __enter__(self):
        def poll():
            while not self.stop.is_set():
                self.peak = max(self.peak, httpx.get(self.s.url + "/health").json()["decoding"])
                time.sleep(0.01)

        self.t = threading.Thread(target=poll)
        self.t.start()
        return self

    def __exit__(self, *a):
        self.stop.set()
        self.t.join()


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Batching alone (no prompt cache), so a request's answer depends only on its company."""
    with serve(tmp_path_factory.mktemp("batch"), "--prompt-cache-bytes", "0") as s:
        yield s


def test_concurrent_requests_get_their_alone_answers_and_none_is_refused(plain):
    c = _client(plain)
    alone = {i: _ask(c, i, stream=False) for i in range(len(PROMPTS))}
    with _Peak(plain) as peak:
        got = _together(lambda i: _ask(c, i, stream=bool(i % 2)), len(PROMPTS))
    assert got == alone
    assert peak.peak >= 2  # they really were decoded together
    h = plain.health()
    assert h["failed"] == 0 and h["queued"] == 0 and h["decoding"] == 0


def test_each_sequence_keeps_its_seed_and_its_grammar(plain):
    c = _client(plain)
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}

    def ask(i):
        if i < 3:  # sampled, seeded
            return _ask(c, i, stream=bool(i % 2), temperature=0.9, seed=100 + i)
        return _ask(c, i, stream=bool(i % 2), temperature=0.8, response_format=fmt, max_tokens=60)

    got = _together(ask, 6)
    for i in range(3):
        assert got[i] == ask(i)  # the same seed alone: the same answer
    for i in range(3, 6):
        jsonschema.validate(json.loads(got[i][0]), SCHEMA)


def test_a_client_leaving_or_a_stop_string_ends_only_its_own_sequence(plain):
    c = _client(plain)
    alone = {i: _ask(c, i, stream=True, max_tokens=60) for i in range(3)}
    stop_at = alone[2][0][10:14]  # a stop string inside request 2's answer
    before = plain.health()
    left = threading.Event()

    def run(i):
        if i == 0:  # reads two tokens, then hangs up
            body = {
                "messages": [{"role": "user", "content": PROMPTS[0]}],
                "max_tokens": 60,
                "temperature": 0,
                "stream": True,
            }
            with httpx.stream("POST", plain.url + "/v1/chat/completions", json=body) as r:
                n = 0
                for line in r.iter_lines():
                    n += line.startswith("data:") and '"content":"' in line
                    if n == 3:
                        break
            left.set()
            return None
        left.wait(60)
        if i == 1:
            return _ask(c, 1, stream=True, max_tokens=60)
        return _ask(c, 2, stream=False, max_tokens=60, stop=[stop_at])

    got = _together(run, 3)
    assert got[1] == alone[1]
    assert got[2] == (alone[2][0][: alone[2][0].index(stop_at)], "stop")
    deadline = time.monotonic() + 20
    while plain.health()["disconnected"] == before["disconnected"]:
        assert time.monotonic() < deadline, "the abandoned sequence was never stopped"
        time.sleep(0.05)
    assert plain.health()["failed"] == 0


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    # --mtp off: the exact counts of the plain path (drafting re-feeds one token; below).
    with serve(tmp_path_factory.mktemp("pcache"), "--ctx", "1024", "--mtp", "off") as s:
        yield s


def _complete(s, ids: list[int], max_tokens: int = 1, stream: bool = False) -> dict:
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0}
    if not stream:
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]
    body.update(stream=True, stream_options={"include_usage": True})
    c = _client(s)
    return [x for x in c.completions.create(model="m", **body)][-1].usage.model_dump()


def _ids(start: int, n: int) -> list[int]:
    return [(start + 7 * k) % 900 + 50 for k in range(n)]


def test_cached_tokens_count_the_prefix_the_cache_gave(cached):
    p, q, r = _ids(0, 300), _ids(3, 20), _ids(5, 30)
    assert _complete(cached, p)["prompt_tokens_details"]["cached_tokens"] == 0
    # max_tokens 1: the answer's token is never fed, so the entries hold exactly p.
    assert _complete(cached, p + q)["prompt_tokens_details"]["cached_tokens"] == 300
    assert _complete(cached, p[:200] + r)["prompt_tokens_details"]["cached_tokens"] == 200
    u = _complete(cached, p + q, stream=True)  # the same prompt: all but its last token
    assert u["prompt_tokens_details"]["cached_tokens"] == 319 and u["prompt_tokens"] == 320
    h = cached.health()["prompt_cache"]
    assert 0 < h["bytes"] <= h["max_bytes"] and h["hits"] >= 3


def test_a_chat_follow_up_reuses_the_history_openai_and_anthropic(cached):
    c = _client(cached)
    msgs = [{"role": "user", "content": "Good morrow, sir. " * 30}]
    first = c.chat.completions.create(model="m", messages=msgs, max_tokens=30, temperature=0)
    msgs += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And what of the king?"},
    ]
    follow = c.chat.completions.create(model="m", messages=msgs, max_tokens=5, temperature=0)
    got = follow.usage.prompt_tokens_details.cached_tokens
    # At least the first prompt (its snapshot), and at most all but the last new token.
    assert first.usage.prompt_tokens <= got < follow.usage.prompt_tokens
    claude = anthropic.Anthropic(base_url=cached.url, api_key="none", max_retries=0)
    kw = dict(model="m", max_tokens=4, messages=[{"role": "user", "content": "Who's there? " * 20}])
    a = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as s:
        b = s.get_final_message()
    total = a.usage.input_tokens + a.usage.cache_read_input_tokens
    assert b.usage.cache_read_input_tokens == total - 1 and b.usage.input_tokens == 1


def test_int2_and_drafting_with_the_prompt_cache(tmp_path):
    """--kv int2 --mtp on: a lone request drafts and reuses the previous prompt's entry with
    its MTP rows (one token less: re-fed); a rollback past the INT2 window gives nothing;
    concurrent requests are all answered."""
    with serve(tmp_path, "--ctx", "1024", "--kv", "int2", "--mtp", "on", "--mtp-k", "1") as s:
        # 700 tokens: past the bf16 rows (sink 64 + recent 512), so the entries hold codes
        p, q, r = _ids(0, 700), _ids(3, 20), _ids(5, 30)
        assert _complete(s, p)["prompt_tokens_details"]["cached_tokens"] == 0
        c = _client(s)
        out = c.completions.create(model="m", prompt=p + q, max_tokens=12, temperature=0)
        assert out.usage.prompt_tokens_details.cached_tokens == 699
        assert out.model_extra["timings"]["draft_n"] > 0
        # 200 tokens back from either entry: further than INT2's window allows.
        back = p[: len(p) - 200] + r
        assert _complete(s, back)["prompt_tokens_details"]["cached_tokens"] == 0
        got = _together(lambda i: _ask(c, i, stream=bool(i % 2)), 4)
        assert all(text for text, _ in got.values())
        assert s.health()["failed"] == 0
