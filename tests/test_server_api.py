"""What clients rely on, through the official `openai` and `anthropic` packages against a real
`macserve serve` subprocess with the demo model: tools and tool_choice, response_format
(JSON that validates, by constrained decoding), logprobs, seed, the default max_tokens cap,
the Anthropic Messages API, and the same constraints with MTP drafting on."""

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from macserve.server import tools
from macserve.server.events import Text, ToolCall
from macserve.server.request import Tool

from .serverproc import serve

KEY = "api-test-key"
CTX = 1024
DEFAULT_MAX = 48  # the server's --default-max-tokens here
ASK = [{"role": "user", "content": "What is the weather in Verona, and in Padua?"}]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
        },
    },
}
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"type": "string"}, "minItems": 1},
            "ok": {"type": "boolean"},
        },
        "required": ["items", "ok"],
    },
    {
        "type": "object",
        "properties": {
            "play": {
                "type": "object",
                "properties": {
                    "acts": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {"title": {"type": "string", "minLength": 2}},
                            "required": ["title"],
                        },
                    },
                    "rating": {"type": "number"},
                },
                "required": ["acts", "rating"],
            },
            "genre": {"enum": ["comedy", "tragedy", "history"]},
        },
        "required": ["play", "genre"],
    },
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 5},
]
PROMPTS = ["Describe a character as JSON.", "ROMEO. But soft, what light through yonder window"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ("--ctx", str(CTX), "--api-key", KEY, "--default-max-tokens", str(DEFAULT_MAX))
    with serve(tmp_path_factory.mktemp("serve-api"), *args) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def _json_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def _streamed_text(stream) -> tuple[str, str]:
    chunks = [c for c in stream if c.choices]
    return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[
        0
    ].finish_reason


# ---- response_format ---------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "list", "nested", "array"])
def test_json_schema_answers_always_validate(client, schema):
    """Sampled (temperature 1) and greedy, streamed and not, a tight and a roomy budget: the
    tiny Shakespeare model, which has never seen JSON, answers JSON that validates."""
    for i, (prompt, temperature, max_tokens) in enumerate(
        [(PROMPTS[0], 1.0, 60), (PROMPTS[1], 0.0, 60), (PROMPTS[0], 0.8, 150)]
    ):
        kw = dict(
            model="m",
            messages=[{"role": "user", "content": prompt}],
            response_format=_json_format(schema),
            max_tokens=max_tokens,
            temperature=temperature,
            seed=i,
        )
        if i % 2:
            text, finish = _streamed_text(client.chat.completions.create(stream=True, **kw))
        else:
            r = client.chat.completions.create(**kw)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
            assert r.usage.completion_tokens <= max_tokens
        jsonschema.validate(json.loads(text), schema)
        assert finish == "stop", (text, finish)  # the grammar ended it, with room to spare


@pytest.mark.e2e
def test_json_object_and_the_default_max_tokens_cap(client):
    """json_object: any JSON object. No max_tokens: the server's --default-max-tokens caps the
    answer (not the rest of the context), and the answer still closes within it."""
    for seed in range(3):
        r = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": PROMPTS[seed % 2]}],
            response_format={"type": "json_object"},
            seed=seed,
        )
        assert isinstance(json.loads(r.choices[0].message.content), dict)
        assert r.usage.completion_tokens <= DEFAULT_MAX
    r = client.chat.completions.create(model="m", messages=ASK, temperature=0)
    assert r.usage.completion_tokens == DEFAULT_MAX and r.choices[0].finish_reason == "length"


@pytest.mark.e2e
def test_json_schema_on_completions_too(server):
    r = httpx.post(
        server.url + "/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={
            "prompt": "KING. Say it plainly:",
            "max_tokens": 40,
            "response_format": _json_format(SCHEMAS[0]),
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), SCHEMAS[0])


@pytest.mark.e2e
@pytest.mark.parametrize(
    "fmt,want",
    [
        ({"type": "json_schema"}, "json_schema"),
        ({"type": "yaml"}, "response_format.type"),
        (_json_format({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "nowhere"),
        (_json_format("not a schema"), "JSON schema object"),
    ],
)
def test_bad_response_formats_are_400(client, fmt, want):
    with pytest.raises(openai.BadRequestError, match=want):
        client.chat.completions.create(model="m", messages=ASK, response_format=fmt)


# ---- tools ----------------------------------------------------------------------------------------


def _check_call(call, allowed: dict):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in allowed
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, allowed[call.function.name]["function"]["parameters"])


@pytest.mark.e2e
def test_tool_choice_required_always_returns_calls_whose_arguments_parse(client):
    allowed = {"get_weather": WEATHER, "get_time": TIME}
    for seed in range(4):
        kw = dict(
            model="m",
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice="required",
            max_tokens=80,
            temperature=1.0,
            seed=seed,
        )
        if seed % 2:
            chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
            deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
            assert deltas and [d.index for d in deltas] == list(range(len(deltas)))
            calls = deltas
            finish = chunks[-1].choices[0].finish_reason
            assert not "".join(c.choices[0].delta.content or "" for c in chunks)
        else:
            r = client.chat.completions.create(**kw)
            calls, finish = r.choices[0].message.tool_calls, r.choices[0].finish_reason
            assert r.choices[0].message.content is None
        assert calls and finish == "tool_calls"
        for c in calls:
            _check_call(c, allowed)


@pytest.mark.e2e
def test_tool_choice_naming_a_function_calls_that_function(client):
    for stream in (False, True):
        kw = dict(
            model="m",
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            parallel_tool_calls=False,
            max_tokens=60,
        )
        if stream:
            chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
            calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
        else:
            calls = client.chat.completions.create(**kw).choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "get_time"
        _check_call(calls[0], {"get_time": TIME})


@pytest.mark.e2e
def test_tools_reach_the_prompt_and_a_tool_conversation_renders(client):
    """The demo model's template knows no tools: they are described in a system message
    (TOOLS_PROMPT), so the prompt grows by their description; a conversation with earlier
    calls and tool results renders and is answered; tool_choice none leaves the tools out."""
    plain = client.chat.completions.create(model="m", messages=ASK, max_tokens=1)
    with_tools = client.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER], max_tokens=1
    )
    none = client.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=1
    )
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Verona", "days": 1}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
    ]
    r = client.chat.completions.create(
        model="m", messages=history, tools=[WEATHER], max_tokens=8, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > with_tools.usage.prompt_tokens


def test_rendering_of_calls_and_results_for_a_template_without_tools():
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "one"},
        {"role": "tool", "tool_call_id": "b", "content": "two"},
    ]
    out, extra = tools.render(msgs, (Tool("f", "F", {"type": "object"}),), tools.OURS)
    assert extra == {}
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "f"' in out[0]["content"]
    assert out[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
    }
    assert out[3] == {
        "role": "user",
        "content": "<tool_response>\none\n</tool_response>\n<tool_response>\ntwo\n</tool_response>",
    }


def test_splitter_finds_calls_across_pieces_and_keeps_other_text():
    t = (Tool("f", "", {"type": "object"}),)
    text = 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"q": "a<b"}}\n</tool_call>\n'
    for size in (1, 3, 7, len(text)):
        s = tools.Splitter(tools.OURS, t)
        events = []
        for i in range(0, len(text), size):
            events += s.feed(text[i : i + size])
        events += s.flush()
        said = "".join(e.text for e in events if isinstance(e, Text))
        calls = [e for e in events if isinstance(e, ToolCall)]
        assert said == "Let me look."  # whitespace around a call is dropped
        assert isinstance(events[-1], ToolCall) and len(calls) == 1
        assert calls[0].name == "f" and json.loads(calls[0].arguments) == {"q": "a<b"}
    s = tools.Splitter(tools.OURS, t)  # not a call: kept as text, nothing lost
    bad = "<tool_call>\nnot json\n</tool_call> and <tool"
    events = s.feed(bad) + s.flush()
    assert all(isinstance(e, Text) for e in events) and "".join(e.text for e in events) == bad


@pytest.mark.e2e
@pytest.mark.parametrize(
    "extra,want",
    [
        ({"tool_choice": "required"}, "needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not in tools",
        ),
        ({"tools": [{"type": "function", "function": {}}]}, "name is required"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be"),
        ({"functions": [{"name": "f"}]}, "functions is not supported"),
    ],
)
def test_bad_tool_requests_are_400(client, extra, want):
    with pytest.raises(openai.BadRequestError, match=want):
        client.chat.completions.create(model="m", messages=ASK, max_tokens=4, **extra)


@pytest.mark.e2e
def test_tools_on_completions_are_400(client):
    with pytest.raises(openai.BadRequestError, match="chat/completions"):
        client.completions.create(
            model="m", prompt="x", max_tokens=4, extra_body={"tools": [WEATHER]}
        )


# ---- logprobs, seed ---------------------------------------------------------------------------


@pytest.mark.e2e
def test_chat_logprobs_streaming_and_not(client):
    kw = dict(model="m", messages=ASK, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    r = client.chat.completions.create(**kw)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    assert "".join(e.token for e in entries) == r.choices[0].message.content
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert e.token == e.top_logprobs[0].token  # greedy takes the most likely token
        assert e.logprob == pytest.approx(tops[0], abs=1e-5) and e.logprob <= 0
        assert sum(2.718281828**t for t in tops) <= 1 + 1e-4
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in entries
    ]


@pytest.mark.e2e
def test_completion_logprobs_legacy_shape(client):
    r = client.completions.create(
        model="m", prompt="ROMEO.\nBut soft", max_tokens=8, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.tokens) == 8
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)


@pytest.mark.e2e
def test_seed_makes_sampling_repeatable(client):
    def ask(seed):
        return (
            client.chat.completions.create(
                model="m", messages=ASK, max_tokens=16, temperature=1.0, seed=seed
            )
            .choices[0]
            .message.content
        )

    assert ask(7) == ask(7)
    assert len({ask(7), ask(8), ask(9)}) > 1


# ---- Anthropic Messages API ---------------------------------------------------------------------


@pytest.mark.e2e
def test_anthropic_messages_streaming_and_not(claude):
    kw = dict(
        model="tiny-mla",
        max_tokens=10,
        extra_body={"temperature": 0},  # (this anthropic release has no temperature argument)
        system="You are a player.",
        messages=[{"role": "user", "content": "Good morrow, sir."}],
    )
    m = claude.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "max_tokens"
    assert m.usage.output_tokens == 10 and m.content[0].type == "text"
    with claude.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == m.content[0].text == final.content[0].text
    assert final.usage.output_tokens == 10 and final.stop_reason == "max_tokens"
    # thinking asked of a model without a thinking mode: accepted, ignored, and said so
    raw = claude.messages.with_raw_response.create(**kw, thinking={"type": "adaptive"})
    assert raw.headers["x-macserve-thinking"].startswith("ignored: ")
    assert [(b.type, b.text) for b in raw.parse().content] == [("text", m.content[0].text)]
    n = claude.messages.count_tokens(model="tiny-mla", system=kw["system"], messages=kw["messages"])
    # Anthropic's split: input_tokens are those not read from the prompt cache.
    assert n.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
    cut = text[2:5]
    s = claude.messages.create(**{**kw, "stop_sequences": [cut]})
    assert s.stop_reason == "stop_sequence" and s.stop_sequence == cut
    assert s.content[0].text == text[: text.index(cut)]


@pytest.mark.e2e
def test_anthropic_errors_are_anthropic_shaped(server, claude):
    with pytest.raises(anthropic.BadRequestError, match="max_tokens is required"):
        claude.post("/v1/messages", body={"model": "m", "messages": ASK}, cast_to=object)
    with pytest.raises(anthropic.BadRequestError, match="not supported"):
        claude.messages.create(
            model="m",
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "url", "url": "x"}}],
                }
            ],
        )
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model="m", max_tokens=4, messages=ASK)
    r = httpx.post(server.url + "/v1/messages", content=b"{oops", headers={"x-api-key": KEY})
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.e2e
def test_models_list_for_both_clients(client, claude):
    assert [m.id for m in client.models.list().data] == ["tiny-mla"]
    assert [m.id for m in claude.models.list().data] == ["tiny-mla"]
    assert client.models.retrieve("tiny-mla").id == "tiny-mla"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


# ---- with MTP drafting ---------------------------------------------------------------------------


@pytest.mark.e2e
def test_constrained_requests_decode_plainly_with_mtp_drafting(tmp_path):
    """--mtp on: drafts are neither masked nor scored, so a constrained or logprobs request
    decodes plainly (no drafts) and stays valid; an unconstrained one drafts."""
    with serve(tmp_path, "--ctx", str(CTX), "--mtp", "on", "--mtp-k", "1") as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
        free = c.chat.completions.create(model="m", messages=ASK, max_tokens=24, temperature=0)
        assert free.model_extra["timings"]["draft_n"] > 0
        for schema in SCHEMAS[:2]:
            r = c.chat.completions.create(
                model="m", messages=ASK, max_tokens=60, response_format=_json_format(schema)
            )
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)
            assert r.model_extra["timings"]["draft_n"] == 0
        r = c.chat.completions.create(
            model="m", messages=ASK, max_tokens=100, tools=[WEATHER], tool_choice="required"
        )
        assert r.choices[0].message.tool_calls and r.model_extra["timings"]["draft_n"] == 0
