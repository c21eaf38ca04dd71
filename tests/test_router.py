"""`macserve router` with real processes: the demo model on macserve's engine and its GGUF twin
on the real llama-server, real supervisord (the router itself one of its services), real HTTP,
the official openai and anthropic clients; launchd through the recording launchctl. TTLs of a
second or two, small budgets by --memory, every wait a poll with a deadline.
"""

import json
import os
import plistlib
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from macserve.errors import MacserveError
from macserve.services import providers
from macserve.services.health import base_url
from macserve.services.profiles import Profile, ProfileStore
from macserve.services.share import share
from macserve.services.supervisors import spec_for
from macserve.services.supervisors.launchd import LaunchdBackend
from macserve.sizing.budget import machine_budget

from .conftest import REPO, TINY_MODEL
from .fixtures import DOMAIN, cli, free_port, poll, router_process, state
from .serverproc import serve

pytestmark = pytest.mark.e2e


def listing(url, key=None) -> dict:
    auth = {"authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(url + "/v1/models", headers=auth, timeout=30)
    assert r.status_code == 200, r.text
    return {m["id"]: m for m in r.json()["data"]}


def log_text(home, name) -> str:
    p = home / "logs" / f"{name}.log"
    return p.read_text(errors="replace") if p.exists() else ""


def starts(home, name) -> int:
    """How many times `macserve run NAME` started the server (its first line in the log)."""
    return log_text(home, name).count(f"macserve run {name}: ")


KEY = "sk-router-test-7"  # the router's own key, where a test sets one


def gpt(url, key="none"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def claude(url, key="none"):
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)


def budget_between(fits: int, not_fits: int) -> int:
    """RAM (bytes) whose GPU budget holds `fits` bytes but not `not_fits`."""
    ram = int((fits + not_fits) / 2 * 1.5)
    b = machine_budget(ram).budget_bytes
    assert fits <= b < not_fits, (fits, b, not_fits)
    return ram


def test_router_on_demand_ttl_eviction_crash_and_clients(
    llama_server,
    model_gguf,
    services,
    macserve_home,
):
    """Three profiles behind a supervised router: the first request to each starts it, a
    third that does not fit beside the other two evicts the least recently used, a TTL of 2s
    stops an idle one, a server killed mid-stream ends that stream with an error event and
    the next request works, and the router itself comes back after kill -9."""
    ports = [free_port() for _ in range(3)]
    for args in (
        [str(TINY_MODEL), "--provider", "macserve", "--name", "tiny", "--ctx", "256"],
        [str(model_gguf), "--name", "gguf", "--ctx", "512", "--extra-args", "-t 1 -np 1"],
        [str(TINY_MODEL), "--provider", "macserve", "--name", "tiny2", "--ctx", "1024"],
    ):
        r = cli("new", *args, "--port", str(ports.pop()), "--no-start")
        assert r.returncode == 0, r.stderr
    # Router keys: no restart (nothing runs yet, and nothing would be restarted anyway).
    r = cli("set", "gguf", "--", "ALIASES=claude-tiny,gpt-tiny")
    assert r.returncode == 0 and "are read by the router" in r.stdout, r.stdout + r.stderr
    assert cli("set", "tiny2", "--", "TTL=2s").returncode == 0

    fp = {n: share(n).share_bytes for n in ("tiny", "gguf", "tiny2")}
    pairs = max(fp["tiny"] + fp["gguf"], fp["gguf"] + fp["tiny2"], fp["tiny"] + fp["tiny2"])
    ram = budget_between(pairs, sum(fp.values()))

    # The router as a supervised service, like any profile.
    rport = free_port()
    r = cli(
        "router", "--install", "--port", str(rport), "--ttl", "60s", "--memory", f"{ram}B",
        "--keep-alive", "0.5",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    url = f"http://127.0.0.1:{rport}"
    assert f"router: routing at {url}/v1" in r.stdout
    show = json.loads(cli("show", "router", "--json").stdout)
    assert show["argv"][1:] == [
        "-m", "macserve", "router", "--host", "127.0.0.1", "--port", str(rport),
        "--ttl", "60s", "--memory", f"{ram}B", "--keep-alive", "0.5",
    ]  # fmt: skip
    router_pid = show["pid"]
    services.append(router_pid)

    # /v1/models: every profile (not the router), stopped, with its share
    models = listing(url)
    assert sorted(models) == ["gguf", "tiny", "tiny2"]
    assert {n: (m["state"], m["share_bytes"]) for n, m in models.items()} == {
        n: ("stopped", fp[n]) for n in fp
    }
    assert models["gguf"]["aliases"] == ["claude-tiny", "gpt-tiny"]
    assert (models["tiny2"]["ttl_s"], models["tiny"]["ttl_s"]) == (2.0, 60.0)
    assert [m.id for m in gpt(url).models.list().data] == ["gguf", "tiny", "tiny2"]
    assert [m.id for m in claude(url).models.list().data] == ["gguf", "tiny", "tiny2"]

    # First request to tiny (openai client): started, answered
    assert state("tiny") == "not installed"
    out = gpt(url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hail."}], max_tokens=4
    )
    assert out.choices[0].message.content and out.usage.completion_tokens >= 1
    assert state("tiny") == "running" and starts(macserve_home, "tiny") == 1

    # First request to gguf, by an alias, through the anthropic client (llama-server's own
    # Messages API), streamed
    with claude(url).messages.stream(
        model="claude-tiny", max_tokens=4, messages=[{"role": "user", "content": "Hail."}]
    ) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text and final.usage.output_tokens >= 1
    assert state("gguf") == "running" and state("tiny") == "running"
    models = listing(url)
    assert (models["tiny"]["state"], models["gguf"]["state"]) == ("running", "running")

    # tiny2 does not fit beside both: tiny, the least recently used, is stopped for it
    stream = gpt(url).chat.completions.create(
        model="tiny2", messages=[{"role": "user", "content": "Hail."}], max_tokens=4, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert (state("tiny"), state("gguf"), state("tiny2")) == ("stopped", "running", "running")
    rlog = log_text(macserve_home, "router")
    assert "tiny: running -> stopping: evicted, least recently used: tiny2 needs" in rlog

    # tiny2's TTL of 2s: stopped once idle; gguf (TTL 60s) keeps running
    poll(lambda: state("tiny2") == "stopped", "tiny2 to be stopped after its TTL", timeout=30)
    assert "tiny2: running -> stopping: idle 2." in log_text(macserve_home, "router")
    assert state("gguf") == "running"
    rows = {x["name"]: x for x in json.loads(cli("ls", "--json").stdout)}
    assert rows["gguf"]["routed"][0]["router"] == url
    assert rows["tiny2"]["routed"][0]["ttl_s"] == 2.0 and rows["router"]["routed"] == []
    table = cli("ls").stdout
    assert f":{rport} ttl 2s" in table and f":{rport} ttl 1m" in table

    # llama-server killed mid-stream: that stream ends with an error event; the router stays
    # up, and the next request waits for the respawned server
    gguf_pid = json.loads(cli("status", "gguf", "--json").stdout)["services"][0]["pid"]
    services.append(gguf_pid)
    stream = gpt(url).chat.completions.create(
        model="gguf",
        messages=[{"role": "user", "content": "Hail."}],
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    got = []
    with pytest.raises(openai.APIError, match="its server went away"):
        for c in stream:
            got.append(c)
            if len(got) == 2:
                os.kill(gguf_pid, signal.SIGKILL)
    assert 2 <= len(got) < 400
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    out = gpt(url).chat.completions.create(
        model="gpt-tiny", messages=[{"role": "user", "content": "Hail."}], max_tokens=4
    )
    assert out.usage.completion_tokens >= 1

    # The router killed: its supervisor brings it back; what runs is adopted, not restarted
    gguf_pid = json.loads(cli("status", "gguf", "--json").stdout)["services"][0]["pid"]
    services.append(gguf_pid)
    os.kill(router_pid, signal.SIGKILL)

    def back():
        s = json.loads(cli("status", "router", "--json").stdout)["services"][0]
        return s["healthy"] and s["pid"] != router_pid

    poll(back, "the router to come back after kill -9", timeout=60)
    assert listing(url)["gguf"]["state"] == "running"
    out = claude(url).messages.create(
        model="gguf", max_tokens=4, messages=[{"role": "user", "content": "Hail."}]
    )
    assert out.content[0].text
    assert json.loads(cli("status", "gguf", "--json").stdout)["services"][0]["pid"] == gguf_pid
    # every move of every profile's state was one the table allows (a refused one is logged
    # with its traceback, in a request's 500 or a failed reaper tick)
    assert "IllegalTransition" not in log_text(macserve_home, "router")


def _keyed_router_profiles(model_gguf, tmp_path):
    """tiny (its own upstream key), bad (weights cut short: cannot load) and gguf, with a RAM
    whose budget holds tiny but not gguf; the router's args for it."""
    broken = tmp_path / "broken"
    shutil.copytree(TINY_MODEL, broken)
    with open(broken / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    for name, args in (
        # tiny's context holds the 900-token stream the disconnect test leaves (below)
        ("tiny", [str(TINY_MODEL), "--provider", "macserve", "--ctx", "1024"]),
        ("bad", [str(broken), "--provider", "macserve", "--ctx", "256"]),
        ("gguf", [str(model_gguf), "--ctx", "512", "--extra-args", "-t 1 -np 1"]),
    ):
        r = cli("new", *args, "--name", name, "--port", str(free_port()), "--no-start")
        assert r.returncode == 0, r.stderr
    # the engine's process alone outweighs this small GGUF's whole share: gguf's share by hand
    twice = 2 * share("tiny").share_bytes
    assert cli("set", "gguf", "--no-restart", "--", f"MEMORY={twice}B").returncode == 0
    fp = {n: share(n).share_bytes for n in ("tiny", "gguf")}
    assert fp["tiny"] < fp["gguf"]
    ram = budget_between(fp["tiny"], fp["gguf"])
    # tiny's server wants its own key; the router wants another, and swaps one for the other
    assert cli("set", "tiny", "--", "API_KEY=sk-tiny-upstream").returncode == 0

    port = free_port()
    args = ["router", "--port", str(port), "--memory", f"{ram}B", "--keep-alive", "0.3"]
    return broken, port, args


def _keyed_router(macserve_home, port, args):
    variables = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        MACSERVE_SERVICE_BACKEND="supervisor",
        MACSERVE_API_KEY=KEY,
    )
    return router_process(macserve_home, args, port, variables)


def test_router_refuses_a_keyed_profile_a_failed_start_a_model_too_big_and_no_model(
    llama_server,
    model_gguf,
    services,
    macserve_home,
    tmp_path,
):
    """Keys: the router's own asked for. A profile that cannot start returns its server's own
    error line (and is left stopped); one bigger than the whole budget is refused at once; an
    unknown model and no model get clear 4xx in each API's shape."""
    broken, port, args = _keyed_router_profiles(model_gguf, tmp_path)
    with _keyed_router(macserve_home, port, args) as router:
        url = router.url
        r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny"}, timeout=30)
        assert r.status_code == 401 and state("tiny") == "not installed"

        # an unknown model, and no model: clear 4xx in each API's shape
        auth = {"authorization": f"Bearer {KEY}"}
        r = httpx.post(url + "/v1/chat/completions", json={"model": "nope"}, headers=auth)
        assert r.status_code == 404 and "known: bad, gguf, tiny" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/chat/completions", json={"messages": []}, headers=auth)
        assert r.status_code == 400 and "`model` is required" in r.json()["error"]["message"]

        # bigger than the budget alone: refused at once, nothing started
        r = httpx.post(
            url + "/v1/messages",
            json={"model": "gguf", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
            headers={"x-api-key": KEY},
            timeout=30,
        )
        assert r.status_code == 400 and r.json()["type"] == "error"
        assert "cannot fit even alone" in r.json()["error"]["message"]
        assert state("gguf") == "not installed"

        # cannot start: a 5xx carrying the engine's own error line; no crash loop left
        with pytest.raises(openai.APIStatusError) as e:
            gpt(url, KEY).chat.completions.create(
                model="bad", messages=[{"role": "user", "content": "Hail."}], max_tokens=4
            )
        assert e.value.status_code == 502
        assert e.value.response.headers["x-should-retry"] == "false"
        msg = e.value.response.json()["error"]["message"]
        assert f"could not load {broken}: RuntimeError: [load_safetensors]" in msg, msg
        assert state("bad") == "stopped"
        assert listing(url, KEY)["bad"]["error"]


def test_router_starts_once_for_racing_requests_keeps_alive_and_passes_disconnects_on(
    llama_server,
    model_gguf,
    services,
    macserve_home,
    tmp_path,
):
    """The profile's key sent upstream in place of the router's; two racing requests start a
    profile once, the streaming one kept alive with SSE comments; a client that goes away
    mid-stream disconnects the server too."""
    _, port, args = _keyed_router_profiles(model_gguf, tmp_path)
    with _keyed_router(macserve_home, port, args) as router:
        url = router.url
        auth = {"authorization": f"Bearer {KEY}"}

        # two requests race for the stopped tiny: one start; the streaming one is kept alive
        results = {}

        def plain():
            results["plain"] = gpt(url, KEY).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hail."}], max_tokens=4
            )

        t = threading.Thread(target=plain)
        t.start()
        lines = []
        with httpx.stream(
            "POST",
            url + "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "Hail."}],
                  "max_tokens": 4, "stream": True},
            headers=auth,
            timeout=120,
        ) as resp:  # fmt: skip
            assert resp.status_code == 200
            lines = [x for x in resp.iter_lines() if x]
        t.join(120)
        assert results["plain"].usage.completion_tokens >= 1
        assert lines[0].startswith(": macserve router: starting tiny"), lines[:3]
        assert lines[-1] == "data: [DONE]"
        assert any(x.startswith("data: {") for x in lines)
        assert starts(macserve_home, "tiny") == 1
        assert router.log.read_text().count("tiny: stopped -> starting") == 1

        # a client that goes away mid-stream: the engine sees it (its /health counts it)
        tiny_url = base_url(ProfileStore().load("tiny"))
        before = httpx.get(tiny_url + "/health", timeout=5).json()["disconnected"]
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            # 900 tokens: the stream must outlast the router passing the disconnect on (200
            # ended first, and counted no disconnect, once the demo decoded faster)
            json={"model": "tiny", "prompt": "HAMLET.", "max_tokens": 900, "stream": True},
            headers=auth,
            timeout=120,
        ) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    break  # and close the connection
        poll(
            lambda: httpx.get(tiny_url + "/health", timeout=5).json()["disconnected"] > before,
            "the engine to see the disconnect",
            timeout=30,
        )
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        # the upstream key went only where it belongs: tiny refuses a request without it
        r = httpx.post(tiny_url + "/v1/completions", json={"prompt": "a", "max_tokens": 1})
        assert r.status_code == 401
        assert "IllegalTransition" not in router.log.read_text()


def test_router_mlx_profile(tiny_mlx_f32, services, macserve_home):
    """mlx_lm.server behind the router: chat works (the router sends mlx-lm its own name for
    the model it serves), the Messages API, which mlx_lm.server lacks, is a clear 400, and the
    Responses API, which it lacks too, is translated to chat and back (router/responses.py)."""
    r = cli("new", str(tiny_mlx_f32), "--name", "mlx", "--port", str(free_port()), "--no-start")
    assert r.returncode == 0, r.stderr
    port = free_port()
    with router_process(macserve_home, ["router", "--port", str(port)], port) as router:
        with pytest.raises(anthropic.BadRequestError, match="has no Anthropic Messages API"):
            claude(router.url).messages.create(
                model="mlx", max_tokens=4, messages=[{"role": "user", "content": "Hail."}]
            )
        assert state("mlx") == "not installed"
        out = gpt(router.url).chat.completions.create(
            model="mlx", messages=[{"role": "user", "content": "Hail."}], max_tokens=4
        )
        assert out.usage.completion_tokens >= 1
        assert listing(router.url)["mlx"]["state"] == "running"
        ask = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hail."}]
        r = gpt(router.url).responses.create(model="mlx", input=ask, max_output_tokens=4)
        assert r.object == "response" and r.model == "mlx" and r.output_text
        assert r.usage.output_tokens == 4 and r.status == "incomplete"
        events = list(
            gpt(router.url).responses.create(
                model="mlx", input=ask, max_output_tokens=4, stream=True
            )
        )
        assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text and events[-1].response.output[0].content[0].text == text


def test_router_drives_launchd(launchctl, macserve_home, tmp_path):
    """The router on the launchd backend, run as its plist says: a request for a stopped
    profile bootstraps its unit (the engine answering on the profile's port stands for the
    job launchd would spawn), and its TTL stops it with the same launchctl calls as
    `macserve stop`."""
    with serve(tmp_path, "--ctx", "256") as engine:
        port = int(engine.url.rsplit(":", 1)[1])
        ProfileStore().save(
            Profile(
                "tiny",
                {"PROVIDER": "macserve", "MODEL": str(TINY_MODEL), "PORT": str(port),
                 "EXTRA_ARGS": "--ctx 256", "TTL": "1s"},
            )
        )  # fmt: skip
        rport = free_port()
        r = cli_launchd("router", "--install", "--port", str(rport), "--no-start")
        assert r.returncode == 0, r.stderr
        # The unit `macserve start router` would install (written, not loaded)
        router_profile = ProfileStore().load("router")
        LaunchdBackend().install(
            spec_for(router_profile, providers.for_profile(router_profile).env(router_profile))
        )
        plist = plistlib.loads(
            (Path(os.environ["MACSERVE_LAUNCH_AGENTS"]) / "dev.macserve.router.plist").read_bytes()
        )
        assert plist["ProgramArguments"][1:] == ["-m", "macserve", "run", "router"]
        penv = plist["EnvironmentVariables"]
        assert penv["MACSERVE_SERVICE_BACKEND"] == "launchd"
        assert penv["MACSERVE_LAUNCHCTL"] == os.environ["MACSERVE_LAUNCHCTL"]
        launchctl()

        # What launchd would run: `macserve run router` with the plist's environment (plus
        # the recording launchctl's own two variables).
        variables = {
            **penv,
            "FAKE_LAUNCHCTL_LOG": os.environ["FAKE_LAUNCHCTL_LOG"],
            "FAKE_LAUNCHCTL_STATE": os.environ["FAKE_LAUNCHCTL_STATE"],
        }
        with router_process(macserve_home, ["run", "router"], rport, variables) as router:
            out = gpt(router.url).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hail."}], max_tokens=4
            )
            assert out.usage.completion_tokens >= 1
            target = f"{DOMAIN}/dev.macserve.tiny"
            plist_path = Path(penv["MACSERVE_LAUNCH_AGENTS"]) / "dev.macserve.tiny.plist"
            calls = launchctl()
            assert ["enable", target] in calls and ["bootstrap", DOMAIN, str(plist_path)] in calls

            # idle past its TTL of 1s: stopped as `macserve stop` stops it
            seen = []

            def disabled():
                seen.extend(c for c in launchctl() if target in c and c[0] != "print")
                return ["disable", target] in seen

            poll(disabled, "the router to stop tiny after its TTL", timeout=30)
            assert seen == [["kill", "SIGTERM", target], ["bootout", target], ["disable", target]]
            assert "tiny: running -> stopping: idle" in router.log.read_text()


def cli_launchd(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "macserve", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def test_ttl_and_aliases_keys(macserve_home):
    p = Profile("a", {"PROVIDER": "llama.cpp", "MODEL": "/m.gguf", "PORT": "1", "TTL": "10m"})
    assert (p.ttl, p.always_on) == (600.0, False)
    p = p.updated({"TTL": "never", "ALIASES": "gpt-4o,qwen3:32b,org/model"})
    assert (p.ttl, p.always_on, p.aliases) == (None, True, ("gpt-4o", "qwen3:32b", "org/model"))
    for bad, why in (
        ({"TTL": "0"}, "bad TTL '0'"),
        ({"TTL": "5 minutes"}, "bad TTL"),
        ({"ALIASES": "a b"}, "bad ALIASES entry 'a b'"),
        ({"ALIASES": "x,x"}, "names a model twice"),
    ):
        with pytest.raises(MacserveError, match=why):
            p.updated(bad)
    st = ProfileStore()
    st.save(p)
    st.save(Profile("b", {"PROVIDER": "llama.cpp", "MODEL": "/m.gguf", "PORT": "2"}))
    r = cli("set", "b", "--", "ALIASES=gpt-4o")
    assert (r.returncode, r.stderr.strip()) == (
        2,
        "error: ALIASES: gpt-4o is already an alias of profile a",
    )
    r = cli("set", "b", "--", "ALIASES=a")
    assert r.stderr.strip() == "error: ALIASES: a is the name of another profile"
    r = cli("set", "b", "--", "TTL=90s")
    assert r.returncode == 0 and "nothing was restarted" in r.stdout
