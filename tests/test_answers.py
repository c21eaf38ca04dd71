"""A job's Steps -> the typed events every dialect renders (server/answers.py): Text with its
tokens' log-probabilities, Thinking, ToolCall, then one Finish whose reason says why it
ended. The job's queue is fed by hand, as the worker would; no model runs."""

import asyncio

from macserve.engine.generate import Step
from macserve.server import tools
from macserve.server.answers import Output, read_steps
from macserve.server.events import Finish, Text, Thinking, ToolCall
from macserve.server.request import GenerationRequest, Tool
from macserve.server.thinking import Think
from macserve.server.worker import END, Job


class _Vocab:
    """The one vocab call read_steps makes: a token id's bytes (here, its decimal digits)."""

    def token_bytes(self, token: int) -> bytes:
        return str(token).encode()


def _events(req: GenerationRequest, steps: list[Step], think: Think | None = None) -> list:
    async def run():
        job = Job([1], 8, 1.0, 1.0, None, asyncio.get_running_loop())
        for s in [*steps, END]:
            job.out.put_nowait(s)
        out = Output(tools.OURS, think)
        return [ev async for ev in read_steps(job, req, _Vocab(), out, "call_")]

    return asyncio.run(run())


def test_a_stop_string_split_across_steps_is_cut_and_named():
    req = GenerationRequest(kind="chat", stop=("STOP",))
    steps = [Step(1, "Hel"), Step(2, "lo ST"), Step(3, "OP more", stats={"completion_tokens": 3})]
    events = _events(req, steps)
    assert events[:-1] == [Text("Hel"), Text("lo ")]  # "ST" held back, never sent
    assert events[-1] == Finish("stop_sequence", "STOP", {"completion_tokens": 3})


def test_a_tool_call_is_its_own_event_and_the_finish_says_tool_calls():
    req = GenerationRequest(kind="chat", tools=(Tool("f", "", {"type": "object"}),))
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    events = _events(req, [Step(1, text[:9]), Step(2, text[9:], "stop")])
    assert events[0] == Text("Sure.")
    assert isinstance(events[1], ToolCall) and events[1].name == "f"
    assert events[1].input() == {"a": 1} and events[1].id.startswith("call_")
    assert isinstance(events[2], Finish) and events[2].reason == "tool_calls"
    assert len(events) == 3


def test_logprobs_ride_with_the_text_their_tokens_wrote():
    req = GenerationRequest(kind="completion", logprobs=True, stop=("X",))
    steps = [
        Step(7, "a", logprob=-0.5, top_logprobs=((7, -0.5), (8, float("-inf")))),
        Step(9, "X", "length", logprob=-1.0),  # the stop string: its token is never shown
    ]
    events = _events(req, steps)
    assert [e.text for e in events if isinstance(e, Text)] == ["a"]
    (lp,) = events[0].logprobs
    assert (lp.raw, lp.logprob, lp.top) == (b"7", -0.5, ((b"7", -0.5),))  # -inf: masked, dropped
    assert events[-1].reason == "stop_sequence" and [e.raw for e in events[-1].logprobs] == [b"9"]


def test_a_think_block_then_a_tool_call_each_its_own_event_and_its_tokens_counted():
    req = GenerationRequest(kind="chat", tools=(Tool("f", "", {"type": "object"}),))
    pieces = ["<think>", "\nUse f", ".\n</th", "ink>\n\n", "<tool_call>\n", '{"name": "f", "arguments": {}}', "\n</tool_call>"]  # fmt: skip
    steps = [Step(i, p) for i, p in enumerate(pieces)]
    steps[-1] = Step(9, pieces[-1], "stop", stats={"completion_tokens": len(pieces)})
    events = _events(req, steps, Think("<think>", "</think>", open=False))
    assert "".join(e.text for e in events if isinstance(e, Thinking)) == "Use f."
    assert not [e for e in events if isinstance(e, Text)]  # the whitespace between: dropped
    (call,) = [e for e in events if isinstance(e, ToolCall)]
    assert call.name == "f" and events[-1].reason == "tool_calls"
    # the tokens written inside the block: "\nUse f", ".\n</th" and "ink>..."
    assert events[-1].stats == {"completion_tokens": 7, "reasoning_tokens": 3}
