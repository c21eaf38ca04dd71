"""`macserve chat` against a real `macserve serve` subprocess: one-shot output and stats, a
scripted session (/system, /clear, /stats, /save), profile and URL targets, clear errors."""

import json
import re

import httpx
import pytest
from click.testing import CliRunner

from macserve.cli import main
from macserve.dev.gguf_export import export_gguf
from macserve.services.profiles import Profile, ProfileStore

from .conftest import TINY_MODEL
from .fixtures import free_port
from .fixtures import llama_serve as _serve
from .serverproc import serve

CTX = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("chat-serve"), "--ctx", str(CTX)) as s:
        yield s


def chat(*args, input=None):
    return CliRunner().invoke(main, ["chat", *args], input=input)


def greedy(server, messages, n):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=60,
        json={"messages": messages, "max_tokens": n, "temperature": 0},
    )
    r.raise_for_status()
    return r.json()


@pytest.mark.e2e
def test_one_shot_prints_the_answer_and_a_stats_line(server):
    r = chat(server.url, "Good morrow.", "--max-tokens", "5", "--temperature", "0")
    assert r.exit_code == 0, r.output
    want = greedy(server, [{"role": "user", "content": "Good morrow."}], 5)
    assert r.stdout == want["choices"][0]["message"]["content"] + "\n"
    n = want["usage"]["completion_tokens"]
    assert (
        r.stderr.startswith(f"{n} tokens, ")
        and "tok/s (server)" in r.stderr
        and "first token" in r.stderr
    )


@pytest.mark.e2e
def test_scripted_session_system_clear_stats_save(server, tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    script = (
        "\n".join(
            [
                "Hail.",
                "/stats",
                "/system You are terse.",
                "/clear",
                f"/save {first}",
                "What news?",
                f"/save {second}",
                "/nonsense",
                "/exit",
                "never sent",
            ]
        )
        + "\n"
    )
    r = chat(
        f"127.0.0.1:{server.url.rsplit(':', 1)[1]}",
        "--max-tokens",
        "4",
        "--temperature",
        "0",
        input=script,
    )
    assert r.exit_code == 0, r.output
    assert "last: " in r.stdout and "session: 1 answer," in r.stdout
    assert "(conversation cleared)" in r.stdout and "unknown command /nonsense" in r.stdout
    a = json.loads(first.read_text())
    assert a["messages"] == [] and a["system"] == "You are terse." and a["model"] == "tiny-mla"
    b = json.loads(second.read_text())
    assert [m["role"] for m in b["messages"]] == ["user", "assistant"]
    # What the server saw for the second question: the system prompt and no earlier turn.
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What news?"},
    ]
    want = greedy(server, msgs, 4)
    assert b["turns"][-1]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert b["messages"][1]["content"] == want["choices"][0]["message"]["content"]
    assert "never sent" not in json.dumps(b)


@pytest.mark.e2e
def test_profile_name_is_a_target(server):
    port = int(server.url.rsplit(":", 1)[1])
    ProfileStore().save(Profile("tiny", {"PROVIDER": "macserve", "MODEL": "x", "PORT": str(port)}))
    r = chat("tiny", "Hail.", "--max-tokens", "2")
    assert r.exit_code == 0, r.output
    r = chat("--max-tokens", "2", input="Hail.\n/stats\n")  # the only profile: the default
    assert r.exit_code == 0 and "session: 1 answer," in r.stdout, r.output
    r = chat("nosuch", "hi")
    assert r.exit_code == 2 and "no profile 'nosuch'" in r.stderr


def test_unreachable_server_is_one_line_error():
    r = chat(f"http://127.0.0.1:{free_port()}", "hi")
    assert r.exit_code == 2
    assert (
        r.stderr.startswith("error: cannot reach http://127.0.0.1:") and r.stderr.count("\n") == 1
    )


@pytest.mark.e2e
def test_server_4xx_is_one_line_error(server):
    r = chat(server.url, "hi", "--max-tokens", str(CTX))
    assert r.exit_code == 2
    assert r.stderr.startswith("error: server answered 400: ") and "context" in r.stderr
    assert r.stderr.count("\n") == 1


@pytest.mark.e2e
def test_errors_inside_a_session_do_not_end_it(server):
    r = chat(server.url, "--max-tokens", str(CTX), input="hi\n/stats\n")
    assert r.exit_code == 0
    assert "error: server answered 400" in r.stdout and "no answers yet" in r.stdout


@pytest.mark.e2e
def test_one_shot_against_llama_server_with_mtp(llama_server, tmp_path):
    gguf = export_gguf(TINY_MODEL, tmp_path / "tiny-mla-f32.gguf")
    port = free_port()
    p = _serve(llama_server, gguf, port, "-c", "512", "--spec-type", "draft-mtp")
    try:
        url = f"http://127.0.0.1:{port}"
        r = chat(url, "Good morrow.", "--max-tokens", "16", "--temperature", "0")
        assert r.exit_code == 0, r.output
        assert re.match(r"^\d+ tokens, [\d.]+ tok/s", r.stderr), r.stderr
        # Whatever llama-server reports about drafting, the stats line must show the same.
        body = {
            "messages": [{"role": "user", "content": "Good morrow."}],
            "max_tokens": 16,
            "temperature": 0,
            "stream": True,
        }
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as s:
            events = [
                json.loads(l[5:])
                for l in s.iter_lines()
                if l.startswith("data:") and "[DONE]" not in l
            ]
        draft = [e["timings"] for e in events if (e.get("timings") or {}).get("draft_n")]
        if draft:
            t = draft[-1]
            assert f"draft acceptance {t['draft_n_accepted'] / t['draft_n']:.0%}" in r.stderr, (
                r.stderr
            )
    finally:
        p.terminate()
        p.wait(timeout=30)
