"""What coding agents send, parsed in process into the neutral request (issue 44): Claude
Code's Messages API fields (server/anthropic/request.py) and Codex's Responses API items
(server/responses/request.py); and what each still refuses, with the field named."""

import pytest

from macserve.server.anthropic.request import parse as parse_messages
from macserve.server.responses.request import parse as parse_responses
from macserve.web.errors import HttpError


def _refused(parse, body) -> HttpError:
    with pytest.raises(HttpError) as e:
        parse(body)
    assert e.value.status == 400
    return e.value


def test_claude_codes_fields():
    body = {
        "model": "claude-sonnet",
        "max_tokens": 32000,
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "system", "content": [{"type": "text", "text": "<env>cwd</env>"}]},
            {"role": "user", "content": "go"},
        ],
        "tools": [
            {"name": "Bash", "input_schema": {"type": "object"}},
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        ],
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": []},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": "u"},
        "stream": True,
        "a_future_field": 1,
    }  # fmt: skip
    req = parse_messages(body)
    assert [m["role"] for m in req.messages] == ["system", "user", "system", "user"]
    assert req.messages[2]["content"] == "<env>cwd</env>"
    assert [t.name for t in req.tools] == ["Bash"]  # the server tool cannot run here
    assert req.thinking is True and req.clamp_max_tokens and req.max_tokens == 32000
    assert parse_messages({**body, "thinking": {"type": "disabled"}}).thinking is False
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    fmt = {"output_config": {"format": {"type": "json_schema", "schema": schema}}}
    assert parse_messages({**body, **fmt}).json_schema == schema
    assert "thinking" in _refused(parse_messages, {**body, "thinking": {"type": "on"}}).message
    e = _refused(parse_messages, {**body, "messages": [{"role": "tool", "content": "x"}]})
    assert e.param == "messages[0].role"


def test_codex_items():
    req = parse_responses(
        {
            "model": "gpt-5-codex",
            "instructions": "You are Codex.",
            "input": [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "ls"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
                {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"cmd":["ls"]}'},
                {"type": "function_call", "call_id": "c2", "name": "shell", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
                {"type": "reasoning", "summary": [], "encrypted_content": "x"},
            ],
            "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}, {"type": "web_search"}],
            "reasoning": {"effort": "none"},
            "max_output_tokens": 100000,
            "store": False,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "k",
        }
    )  # fmt: skip
    roles = [m["role"] for m in req.messages]
    assert roles == ["system", "system", "user", "assistant", "tool"]
    assert req.messages[3]["content"] == "Sure."  # the text and both calls: one assistant turn
    assert [c["id"] for c in req.messages[3]["tool_calls"]] == ["c1", "c2"]
    assert [t.name for t in req.tools] == ["shell"] and req.thinking is False
    assert req.clamp_max_tokens and req.echo["tools"][0]["name"] == "shell"
    for body, param in (
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"type": "local_shell_call", "call_id": "x"}]}, "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0]"),
        ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({}, "input"),
    ):  # fmt: skip
        assert _refused(parse_responses, body).param == param
