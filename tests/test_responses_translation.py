"""The router's side of issue 44, in process: a /v1/responses request for a server with only
chat completions (mlx_lm.server) translated there and back (router/responses.py), its answer
read by the official `openai` package's own types, whole and streamed (chunks cut anywhere);
and each dialect's keep-alive while a model starts (router/keepalive.py), read by the
official clients' SSE rules."""

import json
from pathlib import Path
from typing import get_args

import httpx
import openai
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent
from openai.types.chat import ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from macserve.router import keepalive
from macserve.router.errors import RouteError
from macserve.router.responses import Translation
from macserve.server.anthropic.render import Stream

CODEX = {
    "model": "mlx",
    "instructions": "You are Codex.",
    "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be terse."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List files."}]},
        {"type": "reasoning", "summary": [], "encrypted_content": None},
        {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"cmd":["ls"]}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "a.py\nb.py"},
    ],
    "tools": [
        {"type": "function", "name": "shell", "description": "Run a command", "strict": False,
         "parameters": {"type": "object", "properties": {"cmd": {"type": "array", "items": {"type": "string"}}}}},
        {"type": "web_search"},
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "store": False,
    "stream": True,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "abc",
}  # fmt: skip


def _sse(*objs) -> bytes:
    return (
        b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs) + b"data: [DONE]\n\n"
    )


def _chunk(delta=None, finish=None, usage=None) -> dict:
    out = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "mlx"}
    out["choices"] = (
        [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    )
    if usage:
        out["usage"] = usage
    return out


# Each event validated strictly by its own type's model (the client itself validates nothing).
EVENTS = {
    get_args(c.model_fields["type"].annotation)[0]: c
    for c in get_args(get_args(ResponseStreamEvent)[0])
}


def _events(raw: bytes) -> list:
    out = []
    for ev in raw.decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in ev.split("\n") if line)
        if lines:
            data = json.loads(lines["data"])
            e = EVENTS[data["type"]].model_validate(data)
            assert lines["event"] == e.type
            out.append(e)
    return out


def test_a_codex_request_becomes_a_chat_request():
    chat = json.loads(Translation(CODEX, "mlx").chat)
    assert [m["role"] for m in chat["messages"]] == [
        "system",
        "system",
        "user",
        "assistant",
        "tool",
    ]
    assert chat["messages"][3]["tool_calls"][0]["function"] == {
        "name": "shell",
        "arguments": '{"cmd":["ls"]}',
    }
    assert chat["messages"][4] == {
        "role": "tool",
        "content": "a.py\nb.py",
        "tool_call_id": "call_1",
    }
    assert [t["function"]["name"] for t in chat["tools"]] == ["shell"]  # web_search cannot run
    assert chat["tool_choice"] == "auto" and chat["parallel_tool_calls"] is False
    assert chat["stream"] and chat["stream_options"] == {"include_usage": True}
    with pytest.raises(RouteError, match="previous_response_id") as e:
        Translation({**CODEX, "previous_response_id": "resp_1"}, "mlx")
    assert e.value.status == 400
    with pytest.raises(RouteError, match=r"input\[0\].role") as e:
        Translation({"input": [{"role": "robot", "content": "x"}]}, "mlx")


def test_a_streamed_chat_answer_becomes_responses_events_wherever_the_bytes_are_cut():
    usage = {
        "prompt_tokens": 30,
        "completion_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 20},
    }
    raw = _sse(
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": "Let me "}),
        _chunk({"content": "look."}),
        _chunk({"tool_calls": [{"index": 0, "id": "call_9", "type": "function",
                                "function": {"name": "shell", "arguments": '{"cmd":'}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '["ls"]}'}}]}),
        _chunk({}, "tool_calls"),
        _chunk(usage=usage),
    )  # fmt: skip
    for step in (len(raw), 7, 1):
        tr = Translation(CODEX, "mlx")
        out = tr.start() + b"".join(tr.feed(raw[i : i + step]) for i in range(0, len(raw), step))
        events = _events(out)
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == "response.completed"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == "Let me look."
        (args,) = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert args.arguments == '{"cmd":["ls"]}'
        final = events[-1].response
        assert [o.type for o in final.output] == ["message", "function_call"]
        assert final.output[1].call_id == "call_9" and final.output[1].name == "shell"
        assert final.usage.input_tokens == 30 and final.usage.output_tokens == 9
        assert final.usage.input_tokens_details.cached_tokens == 20
        assert final.model == "mlx" and final.tools[0].name == "shell"


def test_a_whole_chat_answer_becomes_a_response_and_errors_pass():
    tr = Translation({**CODEX, "stream": False, "max_output_tokens": 5}, "mlx")
    assert json.loads(tr.chat)["max_tokens"] == 5 and "stream" not in json.loads(tr.chat)
    answer = {
        "id": "c",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
    }  # fmt: skip
    r = Response.model_validate(json.loads(tr.whole(json.dumps(answer).encode(), 200)))
    assert r.output_text == "Hello" and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens" and r.usage.total_tokens == 8
    err = b'{"error": {"message": "no"}}'
    assert tr.whole(err, 404) == err


def test_keep_alives_in_each_dialect():
    ping = keepalive.event("/v1/messages", "claude-tiny", "tiny", 3.2, True)
    assert ping == b'event: ping\ndata: {"type":"ping"}\n\n'  # the anthropic SDKs skip these
    comment, note = keepalive.event("/v1/chat/completions", "gpt-tiny", "tiny", 12.4, True).split(
        b"\n\n", 1
    )
    assert comment == b": macserve router: starting tiny (12s)"  # what `macserve chat` shows
    assert note.startswith(b"data: ") and note.endswith(b"\n\n")
    chunk = ChatCompletionChunk.model_validate(json.loads(note[6:]))
    assert chunk.model == "gpt-tiny" and chunk.choices[0].delta.content is None
    assert chunk.choices[0].delta.reasoning_content == "loading tiny, 12 s\n"
    for path, on in (
        ("/v1/chat/completions", False),
        ("/v1/responses", True),
        ("/v1/completions", True),
    ):
        assert (
            keepalive.event(path, "a", "tiny", 1.0, on)
            == b": macserve router: starting tiny (1s)\n\n"
        )


def test_the_loading_note_opens_the_answer_and_the_servers_stream_continues_it():
    """Anthropic's stream after a note, cut anywhere: the same events, its blocks after the
    note's, read by the anthropic SDK's own accumulator; without the note, pings and the
    stream untouched."""
    s = Stream("msg_1", "tiny", 30, cached=20)
    upstream = b"".join(s.start() + s.text("Hi") + s.finish("stop", None, {"prompt_tokens": 30, "cached_tokens": 20, "completion_tokens": 1}))  # fmt: skip
    outs = []
    for size in (len(upstream), 7):
        kept = keepalive.for_request("/v1/messages", "claude-tiny", "tiny", True)
        out = kept.tick(1.0) + kept.tick(2.0)
        for i in range(0, len(upstream), size):
            out += kept.feed(upstream[i : i + size])
        outs.append(out + kept.rest())
    assert outs[0].split(b"\n\n", 1)[1] == outs[1].split(b"\n\n", 1)[1]  # all but the id
    adapter = TypeAdapter(RawMessageStreamEvent)
    snap = None
    for ev in outs[0].split(b"\n\n")[:-1]:
        data = json.loads(ev.split(b"data: ", 1)[1])
        if data["type"] == "ping":  # the SDK's stream skips these before accumulating
            continue
        snap = accumulate_event(
            event=adapter.validate_python(data), current_snapshot=snap, json_bufs={}
        )
    assert snap.model == "claude-tiny"
    assert [b.type for b in snap.content] == ["thinking", "text"]
    assert snap.content[0].thinking == "loading tiny, 1 s\nloading tiny, 2 s\n"
    assert snap.content[1].text == "Hi" and snap.stop_reason == "end_turn"
    assert snap.usage.input_tokens == 10 and snap.usage.cache_read_input_tokens == 20

    off = keepalive.for_request("/v1/messages", "claude-tiny", "tiny", False)
    assert off.tick(1.0) == keepalive.PING and off.feed(upstream) == upstream


# mlx_lm.server's own chunks for a thinking model, streamed and whole (where and how they were
# recorded: the file's `recorded`). Its thinking is the delta's or message's `reasoning`.
MLX_LM = json.loads((Path(__file__).parent / "data" / "mlx_lm_thinking.json").read_text())


def _client(answer: bytes, stream: bool) -> openai.OpenAI:
    """The official client, its transport handing back `answer`: what the router writes."""
    kind = "text/event-stream" if stream else "application/json"
    reply = httpx.MockTransport(lambda _: httpx.Response(200, content=answer, headers={"content-type": kind}))  # fmt: skip
    return openai.OpenAI(
        base_url="http://router/v1", api_key="none", http_client=httpx.Client(transport=reply)
    )


def test_mlx_lm_servers_thinking_becomes_a_reasoning_item_whole_and_streamed():
    ask = {"model": "mlx", "input": "Good morrow.", "reasoning": {"effort": "medium"}}
    assert json.loads(Translation(ask, "mlx").chat)["chat_template_kwargs"] == {
        "enable_thinking": True
    }
    none = json.loads(Translation({**ask, "reasoning": {"effort": "none"}}, "mlx").chat)
    assert none["chat_template_kwargs"] == {"enable_thinking": False}
    # llama-server's name for the same field (its chat chunks, recorded beside these); and
    # a newline before the thinking, as a model that writes `\n<think>` itself (GLM) gets it
    raw = MLX_LM["stream"].encode()
    newline = b"data: " + json.dumps(_chunk({"content": "\n"})).encode() + b"\n\n"
    for upstream in (raw, raw.replace(b'"reasoning":', b'"reasoning_content":'), newline + raw):
        for step in (len(upstream), 1):
            tr = Translation({**ask, "stream": True}, "mlx")
            out = tr.start() + b"".join(
                tr.feed(upstream[i : i + step]) for i in range(0, len(upstream), step)
            )
            with _client(out, True).responses.stream(**ask) as s:
                events = list(s)  # the SDK checks each event against the response so far
            final = events[-1].response  # cut by max_tokens: response.incomplete
            assert [o.type for o in final.output] == ["reasoning", "message"]
            # the think block's whitespace dropped, as the engine drops it
            assert final.output[0].content[0].text == "S" and final.output_text == "I'll"
            deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
            assert "".join(deltas) == "S"
            assert final.status == "incomplete" and final.usage.output_tokens == 8

    tr = Translation(ask, "mlx")
    whole = json.dumps(MLX_LM["whole"]).encode()
    r = _client(tr.whole(whole, 200), False).responses.create(**ask)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "S" and r.output_text == "I'll"
    assert r.usage.output_tokens_details.reasoning_tokens == 0  # mlx_lm.server counts none
    # where the usage counts them (OpenAI's completion_tokens_details), they are counted
    usage = {**MLX_LM["whole"]["usage"], "completion_tokens_details": {"reasoning_tokens": 3}}
    counted = json.dumps({**MLX_LM["whole"], "usage": usage}).encode()
    r = _client(tr.whole(counted, 200), False).responses.create(**ask)
    assert r.usage.output_tokens_details.reasoning_tokens == 3
