"""Issue 44 item 6 at its smallest shape: an agent's tool loop, in each agent's own request
shape (Claude Code's Anthropic messages, Codex's Responses API, opencode's chat completions:
macserve/dev/agent_shapes.py, modelled on `macserve bench agent --record`'s recordings), is
served from the engine's prompt cache: every turn after the first has at least 90 % of its
prompt, and all of the turn before's, read from the cache, as the server's own usage says.

The loop's text is tests/data/agent_loop.json (written for this test, none of the agents'):
a system prompt, an environment block, the task, two tool calls with their results, on the
demo model in process (its 1,024-token context: a first prompt of ~800 tokens and ~80 more a
turn, so 90 % is what a turn that reuses the whole previous prompt reaches here). The real
agents' loops at their real size (12-20K tokens, ten turns) through the router, on the engine
and llama-server, are `macserve bench agent`'s (docs/agents.md).

A line that changes at the top of the prompt (Claude Code's billing header differs from one
session to the next) leaves nothing to reuse: the last test shows the measure sees it, so
the first would fail if a turn stopped extending the one before.
"""

import dataclasses
import json
import time

import pytest

from macserve.dev import agent_loop, agent_shapes

from .conftest import TINY_MODEL
from .fixtures import REPO

pytestmark = pytest.mark.model

CTX = 1024
AGENTS = ("claude", "codex", "opencode")


def script() -> agent_shapes.Script:
    d = json.loads((REPO / "tests" / "data" / "agent_loop.json").read_text())
    d.pop("_source")
    d["tools"] = tuple(d["tools"])
    d["steps"] = tuple(tuple(s) for s in d["steps"])
    return agent_shapes.Script(**d)


@pytest.fixture(scope="module")
def client():
    """`macserve serve`'s app on the demo model, in process."""
    from starlette.testclient import TestClient

    from macserve.server.app import create_app
    from macserve.server.settings import Settings

    app = create_app(Settings(str(TINY_MODEL), ctx=CTX))
    # TestClient's default Host (testserver) is not a loopback name: the Host check refuses it
    with TestClient(app, base_url="http://127.0.0.1") as c:
        deadline = time.monotonic() + 60
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "not ready within 60 s"
            time.sleep(0.05)
        yield c


def replay(client, turns) -> list[agent_loop.Result]:
    return [
        agent_loop.send(client, "", t, n, agent_loop.prepared(t, "tiny-mla", 1))
        for n, t in enumerate(turns, 1)
    ]


def table(rows) -> str:
    return "\n".join(f"turn {r.turn}: {r.cached}/{r.prompt} = {r.share:.1%}" for r in rows)


@pytest.mark.parametrize("agent", AGENTS)
def test_every_turn_after_the_first_is_served_from_the_cache(client, agent):
    rows = replay(client, agent_shapes.loop(agent, script()))
    assert len(rows) == 3
    for before, r in zip(rows, rows[1:]):
        assert r.share >= 0.9, f"{agent}:\n{table(rows)}"
        assert r.cached >= before.prompt, (
            f"{agent}: the previous prompt not all reused\n{table(rows)}"
        )


def test_a_changed_first_line_leaves_nothing_to_reuse(client):
    """Claude Code's shape, its second turn with another header line (as its cc_version
    fingerprint differs between sessions): what follows the change cannot come from the
    cache, and the measure says so."""
    base = script()
    first = agent_shapes.loop("claude", base)[0]
    second = agent_shapes.loop("claude", dataclasses.replace(base, header="x-billing: v=1.0.def;"))[
        1
    ]
    rows = replay(client, [first, second])
    assert rows[1].share < 0.1, table(rows)


def test_the_recorded_shapes_only_append():
    """What `bench agent` reports from recordings: consecutive turns of each shape extend one
    another (a text block list against the same text as a string, a moved cache_control, are
    not changes a template renders); a changed header line is."""
    s = script()
    for agent in AGENTS:
        turns = agent_shapes.loop(agent, s)
        assert [agent_loop.first_change(a.body, b.body) for a, b in zip(turns, turns[1:])] == [
            None,
            None,
        ]
    a = agent_shapes.loop("claude", s)[0].body
    b = agent_shapes.loop("claude", dataclasses.replace(s, header="x-billing: v=1.0.def;"))[1].body
    assert agent_loop.first_change(a, b) == "system"
    listed = json.loads(json.dumps(a))
    listed["messages"][1]["content"] = [{"type": "text", "text": s.environment}]
    assert agent_loop.first_change(listed, agent_shapes.loop("claude", s)[1].body) is None
