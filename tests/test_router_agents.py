"""An agent's first request through `macserve router` to a stopped profile (issue 44, items 1
and 5): the router starts the demo model on the engine while the streamed request waits, and
the wait is kept alive with a visible note in the request's own dialect (a thinking block
for Anthropic's Messages API, a reasoning item's summary for the Responses API, each before
an intact answer, read by the official clients); then Codex's Responses API forwarded to the
engine, through the official `openai` client, whole and streamed with a tool."""

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import jsonschema
import openai
import pytest

from .conftest import TINY_MODEL
from .fixtures import cli, free_port, router_process, status

pytestmark = pytest.mark.e2e

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def test_a_cold_start_is_kept_alive_then_each_dialect_round_trips_a_tool(services, macserve_home):
    r = cli(
        "new", str(TINY_MODEL), "--provider", "macserve", "--name", "tiny", "--ctx", "512",
        "--port", str(free_port()), "--no-start",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    port = free_port()
    args = ["router", "--port", str(port), "--ttl", "5m", "--keep-alive", "0.2"]
    with router_process(macserve_home, args, port) as router:
        # Claude Code's way in and Codex's at once: streamed, to a model not yet running (its
        # start takes seconds, many keep-alive intervals), each read by its official client
        claude = anthropic.Anthropic(base_url=router.url, api_key="none", max_retries=0)
        gpt = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)

        def messages():
            with claude.messages.stream(
                model="tiny",
                max_tokens=32000,
                thinking={"type": "adaptive"},
                messages=[
                    {"role": "user", "content": "Good morrow."},
                    {"role": "system", "content": "<env>cwd: /tmp</env>"},
                    {"role": "user", "content": "Speak."},
                ],
                stop_sequences=["\n"],
                extra_query={"beta": "true"},
                extra_body={"temperature": 0},
            ) as s:
                return list(s), s.get_final_message()

        def responses():
            with gpt.responses.stream(model="tiny", input="Hi", max_output_tokens=4) as s:
                return list(s)  # the SDK checks each event against the response so far

        with ThreadPoolExecutor(2) as pool:
            waits = pool.submit(messages), pool.submit(responses)
            (events, final), answer = (w.result(timeout=120) for w in waits)
        services.append(status("tiny")["pid"])
        # the note: a thinking block first, one line a keep-alive; then the answer, intact
        note, *rest = final.content
        assert note.type == "thinking" and note.thinking.startswith("loading tiny, ")
        assert len(note.thinking.splitlines()) >= 2  # more than one keep-alive went by
        text = "".join(
            e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"
        )  # fmt: skip
        assert [b.type for b in rest] == ["text"] and rest[0].text == text and text
        assert final.stop_reason in ("stop_sequence", "end_turn", "max_tokens")
        assert final.usage.input_tokens + final.usage.cache_read_input_tokens > 0
        # Codex's: the note a reasoning item's summary, then the answer's message
        done = answer[-1].response
        assert [e.sequence_number for e in answer] == list(range(len(answer)))
        assert done.output[0].type == "reasoning"
        assert done.output[0].summary[0].text.startswith("loading tiny, ")
        assert done.output[1].type == "message" and done.output_text
        assert done.output_text == "".join(
            e.delta for e in answer if e.type == "response.output_text.delta"
        )

        r = gpt.responses.create(
            model="tiny",
            input=[
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ],
            max_output_tokens=4,
        )
        assert r.model == "tiny" and r.usage.output_tokens == 4 and r.output_text
        stream = gpt.responses.create(
            model="tiny",
            input="Weather in Verona?",
            tools=[WEATHER],
            tool_choice="required",
            max_output_tokens=40,
            stream=True,
        )
        done = [e for e in stream if e.type == "response.function_call_arguments.done"]
        assert done and all(isinstance(json.loads(e.arguments), dict) for e in done)
        round_trips(claude, gpt, done[0])


def round_trips(claude, gpt, done) -> None:
    """A tool round trip in each dialect through the router (issue 44 item 4, at the
    protocol level: no agent's CLI can force a tool call): the call forced by tool_choice
    comes back, its result is sent, and the final answer (tool_choice none) comes."""
    ask = [{"role": "user", "content": "Weather in Verona?"}]
    result = "sunny, 21 C"
    # the Responses API: the streamed call above, its output sent back as an item
    call = {"type": "function_call", "call_id": done.item_id, "name": done.name,
            "arguments": done.arguments}  # fmt: skip
    output = {"type": "function_call_output", "call_id": done.item_id, "output": result}
    r = gpt.responses.create(
        model="tiny", input=[*ask, call, output], tools=[WEATHER], tool_choice="none",
        max_output_tokens=5,
    )  # fmt: skip
    assert [o.type for o in r.output] == ["message"] and r.output_text

    # Anthropic's Messages API: forced by name (whole) and to any tool (streamed)
    tool = {"name": "get_weather", "description": WEATHER["description"],
            "input_schema": WEATHER["parameters"]}  # fmt: skip
    kw = dict(
        model="tiny", max_tokens=60, messages=ask, tools=[tool], extra_body={"temperature": 0}
    )
    m = claude.messages.create(**kw, tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})  # fmt: skip
    with claude.messages.stream(**kw, tool_choice={"type": "any"}) as s:
        streamed = s.get_final_message()
    for msg in (m, streamed):
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert msg.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
        assert uses[0].id.startswith("toolu_")
        jsonschema.validate(uses[0].input, tool["input_schema"])
    (use,) = [b for b in m.content if b.type == "tool_use"]
    final = claude.messages.create(
        model="tiny", max_tokens=5, tools=[tool], tool_choice={"type": "none"},
        messages=[*ask, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}],
    )  # fmt: skip
    assert [b.type for b in final.content] == ["text"] and final.content[0].text
    assert final.stop_reason in ("end_turn", "max_tokens")

    # chat completions
    fn = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}  # fmt: skip
    c = gpt.chat.completions.create(
        model="tiny", messages=ask, tools=[fn], max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
    )  # fmt: skip
    (tc,) = c.choices[0].message.tool_calls
    assert c.choices[0].finish_reason == "tool_calls" and tc.function.name == "get_weather"
    assert isinstance(json.loads(tc.function.arguments), dict)
    final = gpt.chat.completions.create(
        model="tiny", tools=[fn], tool_choice="none", max_tokens=5,
        messages=[*ask, c.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": tc.id, "content": result}],
    )  # fmt: skip
    assert not final.choices[0].message.tool_calls and final.choices[0].message.content
