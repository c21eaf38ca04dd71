"""The router's doors (issue 26 item 7), with a real router process and real HTTP: no
requests served to profiles with their own key by a router without one (unless told), a
forged Host refused, deeply nested JSON a 400, every refusal in the shared error format and
no traceback in the log. Nothing here starts a model: each refusal comes first.
"""

import httpx
import pytest

from .conftest import TINY_MODEL
from .fixtures import cli, free_port, router_process, state

pytestmark = pytest.mark.e2e


def _tiny_with_key():
    r = cli(
        "new",
        str(TINY_MODEL),
        "--provider",
        "macserve",
        "--name",
        "tiny",
        "--ctx",
        "256",
        "--port",
        str(free_port()),
        "--no-start",
    )
    assert r.returncode == 0, r.stderr
    assert cli("set", "tiny", "--", "API_KEY=sk-tiny-upstream").returncode == 0


def test_keyless_router_refuses_keyed_profiles_forged_host_and_deep_json(
    services,  # noqa: F811
    macserve_home,
):
    _tiny_with_key()
    port = free_port()
    with router_process(macserve_home, ["router", "--port", str(port)], port) as router:
        url = router.url
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=30)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "router_has_no_key"
        assert "--allow-unauthenticated" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/messages", json=chat, timeout=30)  # Anthropic's shape there
        assert r.status_code == 401 and r.json()["type"] == "error", r.text
        assert state("tiny") == "not installed"  # refused before anything started
        # the profile's key is never shown: not in the answer, not in the listing
        assert "sk-tiny-upstream" not in r.text
        assert "sk-tiny-upstream" not in httpx.get(url + "/v1/models", timeout=30).text

        # DNS rebinding: a page on evil.example whose name resolves to 127.0.0.1
        r = httpx.get(url + "/v1/models", headers={"host": "evil.example"}, timeout=30)
        assert r.status_code == 400 and "evil.example" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/chat/completions", json=chat, headers={"host": "evil.example:80"})
        assert r.status_code == 400
        assert httpx.get(url + "/v1/models", headers={"host": f"localhost:{port}"}).is_success

        # 10,000-deep JSON: the client's 400 in the API's shape, not a 500 with a traceback
        deep = b'{"model": "tiny", "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
        for path in ("/v1/chat/completions", "/v1/messages"):
            r = httpx.post(url + path, content=deep, timeout=30)
            assert r.status_code == 400, r.text
            assert "nested more than 64 levels" in r.text
        r = httpx.post(url + "/v1/chat/completions", content=b"[" * 10_000, timeout=30)
        assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/chat/completions", content=b"{not json", timeout=30)
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        # too large: 413, before the body is read
        r = httpx.post(url + "/v1/chat/completions", content=b" " * (9 * 2**20), timeout=60)
        assert r.status_code == 413, r.text
    log = router.log.read_text()
    # one line at start naming the keyed profile and both ways out
    starts = [ln for ln in log.splitlines() if "own API key" in ln]
    assert len(starts) == 1 and "tiny" in starts[0] and "--allow-unauthenticated" in starts[0]
    assert "Traceback" not in log and "sk-tiny-upstream" not in log

    # told so: the request gets past the key check (to the budget's refusal, which starts
    # nothing: the model is bigger than a 1 MB Mac's budget)
    port = free_port()
    args = ["router", "--port", str(port), "--allow-unauthenticated", "--memory", "1MB"]
    with router_process(macserve_home, args, port) as router:
        r = httpx.post(router.url + "/v1/chat/completions", json=chat, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_too_large", r.text
        assert state("tiny") == "not installed"
    assert "own API key" not in router.log.read_text()

    # a router with its own key serves it (the key in front; the profile's sent upstream)
    port = free_port()
    args = ["router", "--port", str(port), "--memory", "1MB", "--api-key", "sk-router"]
    args += ["--allowed-hosts", "studio.lan"]
    with router_process(macserve_home, args, port) as router:
        r = httpx.post(router.url + "/v1/chat/completions", json=chat, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        auth = {"authorization": "Bearer sk-router"}
        r = httpx.post(router.url + "/v1/chat/completions", json=chat, headers=auth, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_too_large", r.text
        named = {**auth, "host": f"studio.lan:{port}"}  # --allowed-hosts adds a name
        assert httpx.get(router.url + "/v1/models", headers=named, timeout=30).is_success
