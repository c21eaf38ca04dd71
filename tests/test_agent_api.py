"""What coding agents send, against one real `macserve serve` on the demo model (issue 44):
Codex's Responses API through the official `openai` client (`responses.create`, whole and
streamed, with a tool and a tool round trip), and a request shaped like Claude Code's first
one through the official `anthropic` client (`?beta=true`, a system turn inside `messages`,
`thinking: adaptive`, `metadata`, `context_management`, `output_config`, an unknown field,
a big tool list, `stream: true`, `max_tokens: 32000` on a 512-token context)."""

import json

import anthropic
import openai
import pytest

from .serverproc import serve

pytestmark = pytest.mark.e2e

CTX = 512  # holds the prompts with a tool described (about 400 tokens): short prefills
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("agent-api"), "--ctx", str(CTX)) as s:
        yield s


@pytest.fixture(scope="module")
def gpt(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)


def test_responses_api_whole_streamed_and_a_tool_round_trip(gpt):
    """Codex's shapes: a developer message and input_text parts; a forced function call
    (whole), its output sent back as items (streamed: the Responses events in order); and
    previous_response_id, which needs stored responses, a clear 400."""
    ask = [
        {"role": "developer", "content": "You are a player."},
        {"role": "user", "content": [{"type": "input_text", "text": "Good morrow."}]},
    ]
    r = gpt.responses.create(model="tiny", input=ask, max_output_tokens=6, temperature=0)
    assert r.object == "response" and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and r.usage.output_tokens == 6

    r = gpt.responses.create(
        model="tiny",
        input="Weather in Verona?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
        store=False,
    )
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and call.name == "get_weather"
    assert isinstance(json.loads(call.arguments)["city"], str)

    history = [
        {"role": "user", "content": "Weather in Verona?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
    ]  # fmt: skip
    events = list(
        gpt.responses.create(
            model="tiny", input=history, tools=[WEATHER], max_output_tokens=5, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and events[-1].response.output[0].content[0].text == text

    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        gpt.responses.create(model="tiny", input="Hi", previous_response_id="resp_1")


def _claude_code_tools(n=21) -> list[dict]:
    """Tools as big as Claude Code's (21, about 60 KB of JSON schema)."""
    return [
        {
            "name": f"Tool{i}",
            "description": f"Tool {i} of the agent. " + "Use it with care; read its rules. " * 40,
            "input_schema": {
                "$schema": "http://json-schema.org/draft-07/schema#",
                "type": "object",
                "properties": {
                    f"arg{j}": {"type": "string", "description": "A parameter of it. " * 6}
                    for j in range(8)
                },
                "required": ["arg0"],
                "additionalProperties": False,
            },
        }
        for i in range(n)
    ]


def test_a_request_shaped_like_claude_codes_first(claude):
    tools = _claude_code_tools()
    assert len(json.dumps(tools)) > 55_000
    system = [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}]  # fmt: skip
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>x</system-reminder>"}]},
        {"role": "system", "content": "<env>Working directory: /tmp/project</env>"},
        {"role": "user", "content": [{"type": "text", "text": "Say hi.", "cache_control": {"type": "ephemeral"}}]},
    ]  # fmt: skip
    betas = ["claude-code-20250219", "interleaved-thinking-2025-05-14"]
    # The whole tool list renders (count_tokens checks no context): far past this context.
    big = claude.beta.messages.count_tokens(
        model="tiny", system=system, messages=messages, tools=tools, betas=betas
    )
    assert big.input_tokens > 10 * CTX

    bash = {
        "name": "Bash",
        "description": "Run a command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
    }

    # A generation that fits: one small tool, the system text padded until a few tokens are left,
    # so max_tokens 32000 is cut to the context's end (not refused) and said so.
    def count(pad: int) -> int:
        s = [{"type": "text", "text": "You are a coding agent." + " Be brief." * pad}]
        return claude.beta.messages.count_tokens(
            model="tiny", system=s, messages=messages, tools=[bash], betas=betas
        ).input_tokens

    # " Be brief." is the same few tokens each time: two counts say how many fit.
    base, per = count(0), (count(10) - count(0)) / 10
    pad = int((CTX - 4 - base) / per)
    while count(pad) > CTX - 4:
        pad -= 1
    n_prompt = count(pad)
    system = [{"type": "text", "text": "You are a coding agent." + " Be brief." * pad}]
    raw = claude.beta.messages.with_raw_response.create(
        model="tiny",
        system=system,
        messages=messages,
        tools=[bash],
        max_tokens=32000,
        stream=True,
        thinking={"type": "adaptive"},
        metadata={"user_id": "user_abc_account_def_session_ghi"},
        betas=betas,
        extra_query={"beta": "true"},  # Claude Code's (TypeScript) client adds it; this one not
        extra_body={
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "medium"},
            "a_field_from_next_year": {"x": 1},
            "temperature": 0,
        },
    )
    assert raw.http_request.url.params["beta"] == "true"
    assert raw.headers["x-macserve-thinking"].startswith("ignored")
    events = list(raw.parse())
    assert events[0].type == "message_start" and events[-1].type == "message_stop"
    final = next(e for e in events if e.type == "message_delta")
    assert final.usage.output_tokens == CTX - n_prompt
    assert final.delta.stop_reason == "model_context_window_exceeded"
