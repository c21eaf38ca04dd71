"""An agent's first request through `macserve router` to a stopped profile (issue 44, items 1
and 5): the router starts the demo model on the engine while the streamed request waits, and
the wait is kept alive in the request's own dialect (Anthropic's `ping` events before the
answer's first event); then Codex's Responses API forwarded to the engine, through the
official `openai` client, whole and streamed with a tool."""

import json

import httpx
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


def _events(lines: list[str]) -> list[str]:
    return [x.removeprefix("event: ") for x in lines if x.startswith("event: ")]


def test_a_cold_start_is_kept_alive_and_the_responses_api_is_routed(services, macserve_home):
    r = cli(
        "new", str(TINY_MODEL), "--provider", "macserve", "--name", "tiny", "--ctx", "512",
        "--port", str(free_port()), "--no-start",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    port = free_port()
    args = ["router", "--port", str(port), "--ttl", "5m", "--keep-alive", "0.2"]
    with router_process(macserve_home, args, port) as router:
        # Claude Code's way in: streamed, ?beta=true, to a model not yet running (its start
        # takes seconds, many keep-alive intervals)
        body = {
            "model": "tiny",
            "max_tokens": 32000,
            "stream": True,
            "thinking": {"type": "adaptive"},
            "messages": [
                {"role": "user", "content": "Good morrow."},
                {"role": "system", "content": "<env>cwd: /tmp</env>"},
                {"role": "user", "content": "Speak."},
            ],
            "stop_sequences": ["\n"],
        }
        url = router.url + "/v1/messages?beta=true"
        with httpx.stream("POST", url, json=body, timeout=120) as resp:
            assert resp.status_code == 200
            events = _events(list(resp.iter_lines()))
        services.append(status("tiny")["pid"])
        first = events.index("message_start")
        assert first >= 2 and set(events[:first]) == {"ping"}, events[:5]
        assert events[-1] == "message_stop"

        gpt = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
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
