"""What coding agents send, against the engine's real app on the demo model, in process
(issue 44): Codex's Responses API through the official `openai` client (`responses.create`,
whole and streamed, with a tool and a tool round trip), a request shaped like Claude Code's
first one through the official `anthropic` client (`?beta=true`, a system turn inside
`messages`, `thinking: adaptive`, `metadata`, `context_management`, `output_config`, an
unknown field, a big tool list, `stream: true`, `max_tokens: 32000` on a 512-token context),
and the model's thinking as each dialect's reasoning (item 1): Anthropic `thinking` blocks
(streamed as thinking deltas), Responses `reasoning` items, chat completions'
`reasoning_content`.

The shipped models have no thinking mode, so the demo model is served with a chat template
that has one (`enable_thinking` opens `<think>` in the generation prompt, as a thinking
Qwen's does): an answer asked to think then starts inside a think block, deterministically,
and what the model writes before any `</think>` is its thinking; one not asked is as before
(mlx-lm passes `enable_thinking` false for a vocabulary without think tokens). Where a think
block ends and the answer starts is the splitter's, tested pure with the text cut
everywhere. The official clients talk to the app over Starlette's TestClient (an
httpx.Client): the server's real routes, without a process to start."""

import json
import shutil
import time

import anthropic
import openai
import pytest

from macserve.server.events import Text, Thinking
from macserve.server.thinking import Splitter, Think

from .conftest import TINY_MODEL

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
THINKING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + "
    "'<|end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
    "{% if enable_thinking %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)
ASK = [{"role": "user", "content": "Good morrow."}]
THINK = {"type": "adaptive"}  # Claude Code's
GREEDY = {"temperature": 0}  # this anthropic client has no temperature argument


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """The demo model with a thinking chat template, its app served in process."""
    from starlette.testclient import TestClient

    from macserve.server.app import create_app
    from macserve.server.settings import Settings

    folder = tmp_path_factory.mktemp("thinking-model")
    for f in TINY_MODEL.iterdir():
        (folder / f.name).symlink_to(f)
    config = json.loads((TINY_MODEL / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").unlink()
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": THINKING_TEMPLATE})
    )
    # TestClient's default Host (testserver) is not a loopback name: the Host check refuses it.
    with TestClient(
        create_app(Settings(str(folder), ctx=CTX)), base_url="http://127.0.0.1"
    ) as http:
        deadline = time.monotonic() + 60
        while http.get("/health").status_code != 200:  # the model loads in the background
            assert time.monotonic() < deadline, "not ready within 60 s"
            time.sleep(0.05)
        yield http
    shutil.rmtree(folder)


@pytest.fixture(scope="module")
def gpt(app):
    return openai.OpenAI(
        base_url="http://127.0.0.1/v1", api_key="none", max_retries=0, http_client=app
    )


@pytest.fixture(scope="module")
def claude(app):
    return anthropic.Anthropic(
        base_url="http://127.0.0.1", api_key="none", max_retries=0, http_client=app
    )


@pytest.mark.model
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


@pytest.mark.model
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
            model="tiny", system=s, messages=messages, tools=[bash], betas=betas, thinking=THINK
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
        thinking=THINK,
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
    assert raw.headers["x-macserve-thinking"] == "on"  # this template has the switch
    events = list(raw.parse())
    assert events[0].type == "message_start" and events[-1].type == "message_stop"
    final = next(e for e in events if e.type == "message_delta")
    assert final.usage.output_tokens == CTX - n_prompt
    assert final.delta.stop_reason == "model_context_window_exceeded"


def _split(think: Think, pieces: list[str]) -> tuple[str, str]:
    s, out = Splitter(think), []
    for p in pieces:
        out += s.feed(p)
    out += s.flush()
    thought = "".join(e.text for e in out if isinstance(e, Thinking))
    text = "".join(e.text for e in out if isinstance(e, Text))
    return thought, text


def test_the_splitter_finds_a_think_block_however_the_text_is_cut():
    closed = Think("<think>", "</think>", open=False)
    answer = "<think>\nFirst, the sum.\n</think>\n\nIt is 19."
    for cut in range(len(answer) + 1):
        for step in (1, 3):
            pieces = [answer[:cut]] + [answer[i : i + step] for i in range(cut, len(answer), step)]
            assert _split(closed, pieces) == ("First, the sum.", "It is 19."), pieces
    # the prompt opened the block: the answer's first words are thinking
    opened = Think("<think>", "</think>", open=True)
    assert _split(opened, ["Hm", "m.</th", "ink>Yes."]) == ("Hmm.", "Yes.")
    assert _split(opened, ["cut short by max_tok", "ens </thi"]) == (
        "cut short by max_tokens </thi",
        "",
    )
    # ... and a model that writes the opening marker anyway (vLLM's and SGLang's R1 parsers
    # take both): the marker is not thinking, however it is cut
    again = "\n<think>\nHmm.</think>Yes."
    for cut in range(len(again) + 1):
        assert _split(opened, [again[:cut], again[cut:]]) == ("Hmm.", "Yes."), cut
    assert _split(opened, ["<", "/think>Yes."]) == ("", "Yes.")  # an empty block
    # no think block, or one quoted mid-answer: all of it is the answer
    assert _split(closed, ["  Yes", ", <think> is a tag"]) == ("", "  Yes, <think> is a tag")
    assert _split(closed, ["<thi", "nking>"]) == ("", "<thinking>")


@pytest.mark.model
def test_thinking_comes_back_as_each_dialects_reasoning(claude, gpt):
    # Anthropic, whole: the reasoning in a thinking block, the header says thinking is on
    raw = claude.messages.with_raw_response.create(
        model="tiny", max_tokens=6, messages=ASK, thinking={"type": "adaptive"}, extra_body=GREEDY
    )
    assert raw.headers["x-macserve-thinking"] == "on"
    m = raw.parse()
    assert m.content[0].type == "thinking" and m.content[0].thinking
    thought = m.content[0].thinking
    # streamed: thinking deltas, the SDK's accumulated message equal to the whole one
    with claude.messages.stream(
        model="tiny", max_tokens=6, messages=ASK, thinking={"type": "adaptive"}, extra_body=GREEDY
    ) as s:
        deltas = [e.delta.thinking for e in s if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]  # fmt: skip
        final = s.get_final_message()
    assert "".join(deltas) == thought == final.content[0].thinking
    # disabled: the template opens no think block, so the same words are the answer's text
    m = claude.messages.create(
        model="tiny", max_tokens=6, messages=ASK, thinking={"type": "disabled"}, extra_body=GREEDY
    )
    assert [b.type for b in m.content] == ["text"] and m.content[0].text

    # Responses: a reasoning item with the text, its tokens counted; streamed the same
    r = gpt.responses.create(
        model="tiny", input=ASK, max_output_tokens=6, reasoning={"effort": "high"}, temperature=0
    )
    (item,) = [o for o in r.output if o.type == "reasoning"]
    assert item.content[0].type == "reasoning_text" and item.content[0].text == thought
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens
    with gpt.responses.stream(
        model="tiny", input=ASK, max_output_tokens=6, reasoning={"effort": "high"}, temperature=0
    ) as s:
        events = list(s)  # the accumulator checks each event against the items so far
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = events[-1].response  # response.incomplete: max_output_tokens ended it
    assert text == thought == done.output[0].content[0].text

    # chat completions (the template's default: mlx-lm passes enable_thinking when the model's
    # vocabulary has think tokens; this one's has none, so it is asked for)
    c = gpt.chat.completions.create(
        model="tiny",
        messages=ASK,
        max_tokens=6,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    assert c.choices[0].message.reasoning_content == thought
