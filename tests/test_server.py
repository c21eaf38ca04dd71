"""`macserve serve` as a real subprocess on loopback, driven by the official openai client and
raw httpx: streaming and not, validation, the context limit, the API key, concurrent clients,
and a client that walks away mid-stream while the server keeps serving."""

import json
import socket
import sys
import threading
import time

import httpx
import openai
import pytest
from click.testing import CliRunner

from macserve.cli import main
from macserve.errors import MacserveError
from macserve.services import providers
from macserve.services.profiles import Profile

from .conftest import TINY_MODEL
from .serverproc import free_port, serve

KEY = "test-key-123"
CTX = 256
HELLO = [{"role": "user", "content": "Good morrow, sir."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("serve"), "--ctx", str(CTX), "--api-key", KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def post(server, path, body=None, content=None, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, content=content, headers=headers, timeout=60)


@pytest.mark.model
def test_health_is_503_while_loading_then_ready(monkeypatch):
    """In process, with the real loader held at a gate: the wait a big model's load takes on
    a Mac, made deterministic (the demo model loads in a fraction of a second)."""
    from starlette.testclient import TestClient

    from macserve.server import worker
    from macserve.server.app import create_app
    from macserve.server.settings import Settings

    gate, real = threading.Event(), worker.load
    monkeypatch.setattr(worker, "load", lambda *a: (gate.wait(60), real(*a))[1])
    # TestClient's default Host (testserver) is not a loopback name: the Host check refuses it.
    app = create_app(Settings(str(TINY_MODEL), ctx=CTX))
    with TestClient(app, base_url="http://127.0.0.1") as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        assert c.post("/v1/completions", json={"prompt": "a"}).status_code == 503
        gate.set()
        deadline = time.monotonic() + 60
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "not ready within 60 s"
            time.sleep(0.05)


@pytest.mark.e2e
def test_health_and_models(server, client):
    h = server.health()
    assert h["status"] == "ok" and h["n_ctx"] == CTX
    assert [m.id for m in client.models.list().data] == ["tiny-mla"]


@pytest.mark.e2e
def test_chat_streaming_matches_non_streaming_and_greedy_is_deterministic(client):
    a = client.chat.completions.create(
        model="tiny-mla", messages=HELLO, max_tokens=6, temperature=0
    )
    b = client.chat.completions.create(
        model="tiny-mla", messages=HELLO, max_tokens=6, temperature=0
    )
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].finish_reason in ("stop", "length")
    assert a.object == "chat.completion" and a.choices[0].message.role == "assistant"
    t = a.model_extra["timings"]
    assert t["prompt_n"] == a.usage.prompt_tokens > 0
    assert t["predicted_n"] == a.usage.completion_tokens <= 6
    assert t["predicted_per_second"] > 0 and 0 <= t["draft_n_accepted"] <= t["draft_n"]
    assert t["mtp"]["mode"] == "auto"  # serve's default: the first request measures drafting

    chunks = list(
        client.chat.completions.create(
            model="tiny-mla",
            messages=HELLO,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == a.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == a.choices[
        0
    ].finish_reason
    assert (
        chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == a.usage.completion_tokens
    )


@pytest.mark.e2e
def test_completions_streaming_and_not(client):
    r = client.completions.create(
        model="tiny-mla", prompt="ROMEO.\nBut soft", max_tokens=5, temperature=0
    )
    assert r.object == "text_completion" and r.usage.completion_tokens <= 5
    s = list(
        client.completions.create(
            model="tiny-mla", prompt="ROMEO.\nBut soft", max_tokens=5, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in s) == r.choices[0].text
    assert s[-1].model_extra["timings"]["predicted_n"] == r.usage.completion_tokens


@pytest.mark.e2e
def test_stop_string_cuts_the_answer(client):
    prompt = "ROMEO.\nBut soft, what light"
    full = (
        client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0)
        .choices[0]
        .text
    )
    assert len(full) >= 4
    cut = full[2:4]
    for stream in (False, True):
        r = client.completions.create(
            model="m",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stop=["@@never", cut],
            stream=stream,
        )
        chunks = list(r) if stream else [r]
        assert "".join(c.choices[0].text for c in chunks) == full[: full.index(cut)]
        assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.e2e
@pytest.mark.parametrize(
    "path,body,want",
    [
        ("/v1/chat/completions", b"{not json", "not valid JSON"),
        ("/v1/chat/completions", b"[1, 2]", "JSON object"),
        ("/v1/chat/completions", {}, "messages is required"),
        ("/v1/chat/completions", {"messages": "hi"}, "non-empty list"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, "content"),
        ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"messages": HELLO, "max_tokens": "ten"}, "max_tokens"),
        ("/v1/chat/completions", {"messages": HELLO, "temperature": 5}, "temperature"),
        ("/v1/chat/completions", {"messages": HELLO, "stream": "yes"}, "stream"),
        ("/v1/chat/completions", {"messages": HELLO, "n": 2}, "n=1"),
        ("/v1/completions", {"max_tokens": 3}, "prompt is required"),
        ("/v1/completions", {"prompt": [1, 99999]}, "vocabulary"),
    ],
)
def test_bad_requests_get_400_with_a_reason(server, path, body, want):
    r = post(server, path, content=body) if isinstance(body, bytes) else post(server, path, body)
    assert r.status_code == 400, r.text
    assert want in r.json()["error"]["message"]


@pytest.mark.e2e
def test_bad_parameters_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="m", messages=HELLO, max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="m", messages=HELLO, temperature=3.5)


@pytest.mark.e2e
def test_prompt_plus_max_tokens_over_the_context_is_400(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=HELLO, max_tokens=CTX)
    assert e.value.code == "context_length_exceeded" and str(CTX) in str(e.value)
    r = post(server, "/v1/completions", {"prompt": "and so " * CTX, "max_tokens": 1})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]


@pytest.mark.e2e
def test_api_key_required_except_for_health(server):
    for key in (None, "wrong"):
        r = post(server, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 1}, key=key)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.e2e
def test_unknown_path_and_method_are_json_errors(server):
    r = httpx.get(server.url + "/v1/nothing", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 405 and "error" in r.json()


@pytest.mark.e2e
def test_concurrent_clients_all_get_answers(client):
    results, errors = {}, []

    def ask(i):
        try:
            if i % 2:
                s = client.chat.completions.create(
                    model="m", messages=HELLO, max_tokens=4, temperature=0, stream=True
                )
                results[i] = "".join(c.choices[0].delta.content or "" for c in s if c.choices)
            else:
                r = client.chat.completions.create(
                    model="m", messages=HELLO, max_tokens=4, temperature=0
                )
                results[i] = r.choices[0].message.content
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(results) == 4
    assert len(set(results.values())) == 1  # queued one at a time: greedy is unaffected by company


@pytest.mark.e2e
def test_client_disconnect_mid_stream_cancels_and_server_keeps_serving(server, client):
    before = server.health()
    body = {"messages": HELLO, "max_tokens": CTX - 20, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as h:
        with h.stream(
            "POST",
            server.url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEY}"},
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data:") and json.loads(line[5:])["choices"][0]["delta"].get(
                    "content"
                ):
                    break  # one real token, then hang up
    r = client.chat.completions.create(model="m", messages=HELLO, max_tokens=3, temperature=0)
    assert r.choices[0].message.content is not None
    deadline = time.monotonic() + 20
    while server.health()["disconnected"] == before["disconnected"]:
        assert time.monotonic() < deadline, "the abandoned generation was never cancelled"
        time.sleep(0.05)
    h = server.health()
    assert h["served"] >= before["served"] + 1 and h["failed"] == 0
    assert server.proc.poll() is None


def test_serve_refuses_a_missing_model_and_a_busy_port(tmp_path):
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "not a model folder" in r.output
    with socket.socket() as s:
        port = free_port()
        s.bind(("127.0.0.1", port))
        s.listen()
        r = CliRunner().invoke(main, ["serve", str(TINY_MODEL), "--port", str(port)])
    assert r.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in r.output
    r = CliRunner().invoke(main, ["serve", str(TINY_MODEL), "--ctx", "99999"])
    assert r.exit_code == 2 and "more than the model's limit 1024" in r.output


@pytest.mark.e2e
def test_non_streaming_and_queued_requests_are_cancelled_when_their_client_leaves(server, client):
    before = server.health()
    auth = {"Authorization": f"Bearer {KEY}"}
    long = {"messages": HELLO, "max_tokens": CTX - 20, "temperature": 0}
    with httpx.Client(timeout=30, headers=auth) as a, httpx.Client(timeout=30, headers=auth) as b:
        with a.stream(
            "POST", server.url + "/v1/chat/completions", json={**long, "stream": True}
        ) as r:
            next(r.iter_lines())  # A holds the worker
            # B waits behind A; it hangs up (a read timeout closes the connection) while queued.
            with pytest.raises(httpx.ReadTimeout):
                b.post(
                    server.url + "/v1/chat/completions",
                    json=long,
                    timeout=httpx.Timeout(30, read=0.3),
                )
    deadline = time.monotonic() + 20
    while server.health()["disconnected"] < before["disconnected"] + 2:
        assert time.monotonic() < deadline, server.health()
        time.sleep(0.05)
    r = client.chat.completions.create(model="m", messages=HELLO, max_tokens=2, temperature=0)
    assert r.choices[0].message.content is not None
    assert server.health()["queued"] == 0


def test_engine_provider_argv_flags_and_checks(macserve_home):
    p = Profile(
        "t",
        {
            "PROVIDER": "macserve",
            "MODEL": str(TINY_MODEL),
            "PORT": "9002",
            "CTX": "256",
            "EXTRA_ARGS": "--mtp-k 1",
        },
    )
    prov = providers.for_profile(p)
    assert prov.argv(p) == [
        sys.executable,
        "-m",
        "macserve",
        "serve",
        str(TINY_MODEL),
        # the disk tier of its prompt cache, kept with the profile's state across restarts
        "--prompt-cache-dir",
        str(macserve_home / "state" / "t" / "prompt-cache"),
        "--prompt-cache-disk",
        "20GB",
        "--shutdown-grace",  # the profile's DRAIN (default 60 s): what a stream gets on a stop
        "60",
        "--host",
        "127.0.0.1",
        "--port",
        "9002",
        "--ctx",
        "256",
        "--mtp-k",
        "1",
    ]
    assert prov.context_args(512) == ["--ctx", "512"]
    assert prov.draft_args(1) == ["--mtp-k", "1"] and prov.draft_args(0) == []
    prov.check_args(p)  # against the real `macserve serve --help`
    for extra, why in (
        ("--bogus 1", "does not accept --bogus"),
        ("--port 1", "set by macserve"),
        ("--ctx 256", "set by macserve from the profile; use the CTX key"),
        ("--kv int2", "use the KV key"),
    ):
        with pytest.raises(MacserveError, match=why):
            prov.check_args(p.updated({"EXTRA_ARGS": extra}))
    with pytest.raises(MacserveError, match="local model folder"):
        prov.check_args(p.updated({"MODEL": "org/not-here"}))


def test_int2_without_a_calibration_is_refused_at_start(tmp_path):
    import shutil

    model = tmp_path / "tiny-no-rotation"
    shutil.copytree(TINY_MODEL, model, ignore=shutil.ignore_patterns("latent-rotation.safetensors"))
    r = CliRunner().invoke(main, ["serve", str(model), "--kv", "int2", "--port", str(free_port())])
    assert r.exit_code == 2
    assert r.output.strip().splitlines()[-1].startswith("error: --kv int2 needs --rotation FILE")
