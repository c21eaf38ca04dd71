"""The real coding agents through `macserve launch` (issue 44, items 2-4): Claude Code (`claude
-p`), Codex (`codex exec`) and opencode (`opencode run`), at the versions scripts/install.sh
pins, each run headless against one router and one llama-server on the real chat model
(SmolLM2-135M, its 8K RoPE stretched to 32K with YaRN: a profile of CTX=32768), and each exits
0 with the model's answer, having gone through the router in its own dialect (Anthropic
messages, the Responses API, chat completions).

The agents' own prompts are shrunk with their own settings, or the tests would take minutes:
their first requests are 15-20K tokens (Claude Code 48-77 KB of JSON, Codex 39 KB, opencode
31 KB) and llama-server prefills SmolLM2 at 50-250 tokens/s on this 2-core machine (docs/
agents.md). Claude Code gets `--bare` (no hooks, CLAUDE.md or attribution reminders:
without it greedy SmolLM2 rambles past any limit on the reminders), `--system-prompt` and
`--tools ""`, Codex a
`model_instructions_file` and its optional tools' features disabled, opencode a project
`opencode.json` whose build agent has a one-line prompt and no tools: about 75, 760 and 115
prompt tokens. Answers are greedy and bounded: none of the agents sends a temperature, and
SmolLM2 at llama-server's default (0.8) once rambled to Claude Code's whole budget (4,096
tokens, 7 minutes here), so the profile says `--temp 0`; Claude Code and opencode ask for 256
tokens (`launch --max-output`; Claude Code fails an answer cut at its limit, so the limit is
well above the greedy answer) and llama-server's `-n 256` caps Codex, which asks for no limit
(`-n` does not cap a request's own max_tokens). No tool round trip
here: SmolLM2's chat template renders no tools (tests/test_real_model.py), so llama-server
leaves them out; the Responses API's tool calls are tests/test_router_agents.py's.

Each agent runs with HOME in a temporary folder: no user config of theirs changes the test,
and they write theirs there."""

import json
import os
import subprocess
import sys

import anthropic
import openai
import pytest

from macserve.services import agents
from macserve.services.supervisors import get_backend

from .fixtures import REPO, free_port, need_llama_server, router_process

pytestmark = pytest.mark.e2e

SYSTEM = "You are a helpful assistant."
PROMPT = "What is the capital of France?"
# llama-server's YaRN: the model's 8,192 trained positions stretched 4x
YARN = "--rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 8192"
CTX = 32768
ANSWER = 256  # tokens: asked by Claude Code and opencode (launch --max-output), Codex's by -n


@pytest.fixture
def macserve_home(home, monkeypatch):
    """fixtures.py's autouse home, overridden: every test here uses the module's."""
    monkeypatch.setenv("MACSERVE_HOME", str(home))
    return home


def need_agent(name: str) -> str:
    """The pinned CLI from scripts/install.sh, or the test fails saying how to get it."""
    p = agents.installed_bin() / name
    if not os.access(p, os.X_OK):
        a = agents.AGENTS[name]
        pytest.fail(
            f"no {name} in {agents.installed_bin()}: `bash scripts/test.sh` installs "
            f"{a.package}@{a.version} there through scripts/install.sh",
            pytrace=False,
        )
    return str(p)


@pytest.fixture(scope="module")
def router(home, seen, smollm_gguf, tmp_path_factory):
    """A 32K profile of the real model (written as a file: `new` refuses a CTX past the
    model's own 8K, which it cannot know YaRN stretches) and a router in front of it, which
    starts it on the first agent's request."""
    need_llama_server()
    (home / "profiles").mkdir(exist_ok=True)
    (home / "profiles" / "smol.env").write_text(
        f"PROVIDER=llama.cpp\nMODEL={smollm_gguf}\nHOST=127.0.0.1\nPORT={free_port()}\n"
        f"CTX={CTX}\nEXTRA_ARGS='-t 1 --temp 0 -n {ANSWER} {YARN}'\n"
    )
    port = free_port()
    work = tmp_path_factory.mktemp("agent-work")
    # --keep-alive 0.5: an agent's request that waits for the model's start (about 3 s) gets
    # the loading note (router/keepalive.py) before its answer, as a user's first one does
    args = ["router", "--port", str(port), "--keep-alive", "0.5"]
    with router_process(home, args, port) as r:
        r.work = work
        yield r
        st = get_backend().status("smol")
        if st.pid:
            seen.append(st.pid)


def launch(router, home, agent: str, *args: str) -> subprocess.Popen:
    """`macserve launch AGENT smol -- ARGS` as a user runs it, in the module's home, with the
    pinned agent first on PATH and HOME a folder of its own; started, not waited for."""
    user = router.work / f"home-{agent}"
    user.mkdir(exist_ok=True)
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        MACSERVE_HOME=str(home),
        MACSERVE_SERVICE_BACKEND="supervisor",
        HOME=str(user),
        PWD=str(router.work),  # opencode takes its project from PWD, not the process's cwd
        # opencode's model catalogue (models.dev) is not needed for a provider of our own, and
        # its fetch waits for the network (6 s here, where there is none)
        OPENCODE_DISABLE_MODELS_FETCH="1",
        PATH=f"{agents.installed_bin()}{os.pathsep}{os.environ['PATH']}",
    )
    for k in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "CODEX_HOME"):
        env.pop(k, None)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "macserve",
            "launch",
            agent,
            "smol",
            "--max-output",
            str(ANSWER),
            "--",
            *args,
        ],  # fmt: skip
        cwd=router.work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )


def codex_lean(work) -> list[str]:
    instructions = work / "instructions.md"
    instructions.write_text(SYSTEM + "\n")
    lean = [
        "-c", f"model_instructions_file={json.dumps(str(instructions))}",
        "-c", 'web_search="disabled"',
    ]  # fmt: skip
    for feature in ("goals", "multi_agent", "view_image", "apps", "plugins", "skill_search",
                    "shell_tool", "unified_exec", "default_mode_request_user_input"):  # fmt: skip
        lean += ["--disable", feature]
    return lean


@pytest.fixture(scope="module")
def runs(router, home) -> dict[str, tuple[int, str, str]]:
    """The three agents started at once, each waited for: their own start-ups (seconds each)
    overlap, the model serves their requests one after another (the router holds the first
    ones while it starts the model)."""
    for name in agents.AGENTS:
        need_agent(name)
    (router.work / "opencode.json").write_text(
        json.dumps({"agent": {"build": {"prompt": SYSTEM, "tools": {"*": False}}}})
    )
    procs = {
        "opencode": launch(router, home, "opencode", "run", "--title", "hello", PROMPT),
        "claude": launch(
            router, home, "claude", "--bare", "-p", PROMPT, "--system-prompt", SYSTEM, "--tools", ""
        ),
        "codex": launch(
            router,
            home,
            "codex",
            *codex_lean(router.work),
            "exec",
            "--skip-git-repo-check",
            PROMPT,
        ),  # fmt: skip
    }
    out = {}
    for name, p in procs.items():
        try:
            so, se = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
            se += "\n(killed after 300 s)"
        out[name] = (p.returncode, so, se)
    return out


def answered(runs, router, agent: str, route: str) -> None:
    code, out, err = runs[agent]
    assert code == 0, out[-2000:] + err[-3000:]
    assert any(c.isalpha() for c in out), (out, err[-2000:])
    assert f'"POST {route} HTTP/1.1" 200' in router.log.read_text(), route


def test_opencode_runs_through_the_router(runs, router):
    answered(runs, router, "opencode", "/v1/chat/completions")


def test_claude_code_runs_through_the_router(runs, router):
    answered(runs, router, "claude", "/v1/messages?beta=true")


def test_codex_runs_through_the_router(runs, router):
    answered(runs, router, "codex", "/v1/responses")


def test_a_tool_result_goes_back_to_llama_server_in_each_dialect(runs, router):
    """The second half of a tool round trip through the router to llama-server (the first
    half cannot happen here: SmolLM2's template renders no tools, so llama-server answers a
    forced tool_choice with text; tests/test_router_agents.py round-trips a forced call on
    the engine): a conversation holding a call and its result, in each dialect's shapes
    through its official client, is forwarded, taken and answered."""
    claude = anthropic.Anthropic(base_url=router.url, api_key="none", max_retries=0)
    gpt = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    args, result = {"city": "Paris"}, "sunny, 21 C"
    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    m = claude.messages.create(
        model="smol", max_tokens=2,
        tools=[{"name": "get_weather", "description": "The weather", "input_schema": params}],
        messages=[ask, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": args}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result}]}],
    )  # fmt: skip
    assert m.content[0].type == "text" and m.content[0].text and m.usage.output_tokens
    fn = {"name": "get_weather", "description": "The weather", "parameters": params}
    r = gpt.responses.create(
        model="smol", max_output_tokens=2, tools=[{"type": "function", **fn}],
        input=[ask, {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": json.dumps(args)},
               {"type": "function_call_output", "call_id": "call_1", "output": result}],
    )  # fmt: skip
    assert r.output_text and r.usage.output_tokens
    c = gpt.chat.completions.create(
        model="smol", max_tokens=2, tools=[{"type": "function", "function": fn}],
        messages=[ask, {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args)}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": result}],
    )  # fmt: skip
    assert c.choices[0].message.content and c.usage.completion_tokens
