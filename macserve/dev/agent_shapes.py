"""An agent's loop written from a short script in each agent's own request shape, as recorded
(`macserve bench agent --record`, agent_capture.py) from the versions services/agents.py pins:

- Claude Code, Anthropic messages (`/v1/messages?beta=true`): `system` as text blocks (a
  billing header line first, then the prompt, marked `cache_control`), the user's turn then an
  environment block as a `system` turn inside `messages`, each call an assistant `tool_use`
  block answered by a user `tool_result` block; the newest block carries `cache_control`,
  which moves on at the next turn (a key no template renders);
- Codex, the Responses API (`/v1/responses`): `developer` and `user` messages of
  `input_text` parts, then `function_call` / `function_call_output` items;
- opencode, chat completions (`/v1/chat/completions`): a system message, the user's, then
  assistant `tool_calls` answered by `tool` messages.

Only the structure is the agents'; the text is the caller's (the tests' fixture is its own).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .agent_loop import Turn


@dataclass(frozen=True)
class Script:
    system: str  # the agent's system prompt
    environment: str  # the environment block it adds (cwd, platform)
    user: str  # the task
    tools: tuple[dict, ...]  # {"name", "description", "parameters"}
    steps: tuple[tuple[str, dict, str], ...]  # (tool, arguments, its result) per turn
    header: str = ""  # a first system line (Claude Code's billing header)


def _claude(s: Script, n: int) -> Turn:
    system = [{"type": "text", "text": s.header}] if s.header else []
    system.append({"type": "text", "text": s.system, "cache_control": {"type": "ephemeral"}})
    messages: list[dict] = [
        {"role": "user", "content": [{"type": "text", "text": s.user}]},
        {"role": "system", "content": s.environment},
    ]
    for i, (name, args, result) in enumerate(s.steps[:n]):
        cid = f"toolu_{i:024d}"
        messages.append(
            {"role": "assistant", "content": [{"type": "tool_use", "id": cid, "name": name, "input": args}]}
        )  # fmt: skip
        block = {"type": "tool_result", "tool_use_id": cid, "content": result}
        messages.append({"role": "user", "content": [block]})
    last = messages[-1] if n else messages[0]  # the environment turn is a plain string
    last["content"][-1]["cache_control"] = {"type": "ephemeral"}
    tools = [
        {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
        for t in s.tools
    ]
    body = {"model": "", "max_tokens": 1, "system": system, "messages": messages, "tools": tools}
    return Turn("/v1/messages?beta=true", {**body, "metadata": {"user_id": "session"}})


def _codex(s: Script, n: int) -> Turn:
    def msg(role, text):
        return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}

    items = [msg("developer", s.system), msg("user", s.environment), msg("user", s.user)]
    for i, (name, args, result) in enumerate(s.steps[:n]):
        cid = f"call_{i:024d}"
        items.append(
            {"type": "function_call", "name": name, "arguments": json.dumps(args), "call_id": cid}
        )
        items.append({"type": "function_call_output", "call_id": cid, "output": result})
    tools = [{"type": "function", **t} for t in s.tools]
    body = {"model": "", "input": items, "tools": tools, "tool_choice": "auto", "store": False}
    return Turn("/v1/responses", body)


def _opencode(s: Script, n: int) -> Turn:
    messages: list[dict] = [
        {"role": "system", "content": s.system + "\n" + s.environment},
        {"role": "user", "content": s.user},
    ]
    for i, (name, args, result) in enumerate(s.steps[:n]):
        cid = f"call_{i:024d}"
        call = {
            "id": cid,
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)},
        }
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": cid, "content": result})
    tools = [{"type": "function", "function": t} for t in s.tools]
    return Turn("/v1/chat/completions", {"model": "", "messages": messages, "tools": tools, "tool_choice": "auto"})  # fmt: skip


SHAPES = {"claude": _claude, "codex": _codex, "opencode": _opencode}


def loop(agent: str, script: Script) -> list[Turn]:
    """The agent's requests over the script: turn k carries the first k-1 steps' calls and
    results (the first turn none; the last all of them)."""
    return [SHAPES[agent](script, n) for n in range(len(script.steps) + 1)]
