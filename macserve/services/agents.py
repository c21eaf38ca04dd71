"""What `macserve launch AGENT` sets for a coding agent's CLI (Claude Code, Codex, opencode) so
that it talks to a macserve endpoint: the rules (`plan`) are pure, from the endpoint, the model,
its context and the key; where the CLI is (`find`) is read from PATH and the npm prefix that
scripts/install.sh fills.

Nothing is written to disk: every agent reads its settings from the environment or from
`-c` overrides in argv, and the key only ever travels in an environment variable (argv is
world-readable in `ps`). What each agent reads, looked up in the CLIs themselves (the versions
in `AGENTS`) and their docs:

- Claude Code: ANTHROPIC_BASE_URL (it appends /v1/messages), ANTHROPIC_AUTH_TOKEN (sent as
  `Authorization: Bearer`; a placeholder when the router has no key, or Claude Code asks to log
  in), ANTHROPIC_MODEL and the ANTHROPIC_DEFAULT_{OPUS,SONNET,HAIKU}_MODEL its aliases and
  background tasks use (else they ask for a Claude model the router has not got),
  CLAUDE_CODE_AUTO_COMPACT_WINDOW (the window its auto-compaction counts from: unset, an
  unknown model is taken to have 200K; it refuses less than 100K, so a smaller context is
  given as CLAUDE_CODE_MAX_CONTEXT_TOKENS, which it reads only with DISABLE_COMPACT: no
  compaction, the server's context-exceeded error at the end), CLAUDE_CODE_MAX_OUTPUT_TOKENS (its default `max_tokens`
  of 32,000 is the whole of a 32K context), CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC (no
  telemetry, error reports or update checks leave the machine).
- Codex: `-c` overrides of config.toml: a `model_providers.macserve` entry (base_url ending in
  /v1, wire_api="responses", env_key naming the variable that holds the key),
  model_provider, model, model_context_window and model_auto_compact_token_limit.
- opencode: OPENCODE_CONFIG_CONTENT, a config merged over the user's: a provider through the
  `@ai-sdk/openai-compatible` package (bundled in opencode) with the model's
  `limit.context` / `limit.output`, the key as `{env:MACSERVE_API_KEY}`, and `model` /
  `small_model` set to it.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .. import env
from ..errors import MacserveError

KEY_VAR = env.API_KEY  # the variable the agents read the router's key from
PLACEHOLDER_KEY = "macserve"  # Claude Code wants some credential even where none is checked
PROVIDER_ID = "macserve"  # the provider's name in Codex's and opencode's configs
MAX_OUTPUT = 32_000  # Claude Code's own default max_tokens
CLAUDE_MIN_COMPACT_WINDOW = 100_000  # Claude Code's floor for CLAUDE_CODE_AUTO_COMPACT_WINDOW
COMPACT_AT = 0.9  # of the context: where Codex compacts (its own default ratio for known models)


@dataclass(frozen=True)
class Agent:
    command: str
    package: str  # on npm
    version: str  # what scripts/install.sh installs and the tests run


AGENTS: dict[str, Agent] = {
    "claude": Agent("claude", "@anthropic-ai/claude-code", "2.1.328"),
    "codex": Agent("codex", "@openai/codex", "0.169.0"),
    "opencode": Agent("opencode", "opencode-ai", "1.18.33"),
}


@dataclass(frozen=True)
class Target:
    """Where the agent's requests go: a router's base URL (no /v1), the model name it routes
    by (a profile or an alias), that profile's context (tokens per sequence; None when the
    profile sets none), the key the router wants (None: it wants none) and the answer budget
    the agent asks for (`launch --max-output`; Codex has no such setting: the server's own
    default, llama-server's `-n`, caps it)."""

    url: str
    model: str
    ctx: int | None
    key: str | None
    output: int | None = None  # the answer budget asked for (None: `output_tokens(ctx)`)


@dataclass(frozen=True)
class Launch:
    """What to exec: argv, the variables to set and to remove in the agent's environment, and
    which of the set ones hold a secret (masked by `--print`)."""

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    unset: tuple[str, ...] = ()
    secrets: frozenset[str] = frozenset()

    def environ(self, base: Mapping[str, str]) -> dict[str, str]:
        out = {k: v for k, v in base.items() if k not in self.unset}
        out.update(self.env)
        return out

    def shown(self) -> list[str]:
        """`--print`'s lines: each variable set (secrets masked), each removed, then argv."""
        lines = [f"{k}={'****' if k in self.secrets else v}" for k, v in self.env.items()]
        lines += [f"unset {k}" for k in self.unset]
        return [*lines, shlex.join(self.argv)]


def output_tokens(ctx: int | None, asked: int | None = None) -> int | None:
    """The answer budget an agent asks for: `asked`, else an eighth of the context (a 32K
    context keeps 28K for the prompt, which is what the agents' first requests take), at least
    1,024 and at most Claude Code's own 32,000."""
    if asked:
        return asked
    if not ctx:
        return None
    return max(1024, min(MAX_OUTPUT, ctx // 8))


def _claude(t: Target, args: tuple[str, ...], exe: str) -> Launch:
    values = {
        "ANTHROPIC_BASE_URL": t.url,
        "ANTHROPIC_AUTH_TOKEN": t.key or PLACEHOLDER_KEY,
        "ANTHROPIC_MODEL": t.model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": t.model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": t.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": t.model,
        "CLAUDE_CODE_SUBAGENT_MODEL": t.model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        # Its system prompt's first line is otherwise a billing header whose cc_version ends
        # in a fingerprint of the session's first prompt: every new session would change the
        # first line, so no server could reuse the cached system prompt and tools (15-20K
        # tokens) from one session to the next (docs/agents.md, the loop section)
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
    }
    out = output_tokens(t.ctx, t.output)
    if out:
        values["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(out)
    if t.ctx:
        if t.ctx >= CLAUDE_MIN_COMPACT_WINDOW:
            values["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = str(t.ctx)
        else:
            # Claude Code raises a smaller compaction window to 100K (and says so), so it
            # would compact too late; it takes a model's real window only with compaction off
            values["DISABLE_COMPACT"] = "1"
            values["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(t.ctx)
    return Launch(
        (exe, *args),
        values,
        # a real Anthropic key (x-api-key) would go to the router beside ours; Bedrock, Vertex,
        # Foundry or another base URL would take the requests elsewhere
        unset=(
            KEY_VAR,  # not read by Claude Code: no other server's key for its tools to see
            "ANTHROPIC_API_KEY",
            "CLAUDE_CODE_API_BASE_URL",
            "CLAUDE_CODE_USE_BEDROCK",
            "CLAUDE_CODE_USE_VERTEX",
            "CLAUDE_CODE_USE_FOUNDRY",
        ),
        secrets=frozenset({"ANTHROPIC_AUTH_TOKEN"} if t.key else ()),
    )


def _toml(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid TOML basic string


def _codex(t: Target, args: tuple[str, ...], exe: str) -> Launch:
    p = f"model_providers.{PROVIDER_ID}"
    overrides = [
        f"model_provider={_toml(PROVIDER_ID)}",
        f"{p}.name={_toml(PROVIDER_ID)}",
        f"{p}.base_url={_toml(t.url + '/v1')}",
        f'{p}.wire_api="responses"',
        f"model={_toml(t.model)}",
    ]
    if t.key:
        overrides.append(f"{p}.env_key={_toml(KEY_VAR)}")
    if t.ctx:
        overrides.append(f"model_context_window={t.ctx}")
        overrides.append(f"model_auto_compact_token_limit={int(t.ctx * COMPACT_AT)}")
    argv = [exe]
    for o in overrides:
        argv += ["-c", o]
    values = {KEY_VAR: t.key} if t.key else {}
    return Launch(
        (*argv, *args),
        values,
        unset=() if t.key else (KEY_VAR,),
        secrets=frozenset(values),
    )


def opencode_config(t: Target) -> dict:
    """opencode's config for the target (OPENCODE_CONFIG_CONTENT)."""
    model: dict = {"name": t.model}
    out = output_tokens(t.ctx, t.output)
    if t.ctx and out:
        model["limit"] = {"context": t.ctx, "output": out}
    options = {"baseURL": t.url + "/v1"}
    if t.key:
        options["apiKey"] = "{env:" + KEY_VAR + "}"  # opencode substitutes it when it loads
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            PROVIDER_ID: {
                "npm": "@ai-sdk/openai-compatible",
                "name": PROVIDER_ID,
                "options": options,
                "models": {t.model: model},
            }
        },
        "model": f"{PROVIDER_ID}/{t.model}",
        "small_model": f"{PROVIDER_ID}/{t.model}",
    }


def _opencode(t: Target, args: tuple[str, ...], exe: str) -> Launch:
    values = {"OPENCODE_CONFIG_CONTENT": json.dumps(opencode_config(t))}
    if t.key:
        values[KEY_VAR] = t.key
    return Launch(
        (exe, *args),
        values,
        unset=() if t.key else (KEY_VAR,),
        secrets=frozenset({KEY_VAR} if t.key else ()),
    )


RULES = {"claude": _claude, "codex": _codex, "opencode": _opencode}


def plan(agent: str, target: Target, args: tuple[str, ...] = (), exe: str | None = None) -> Launch:
    """What `launch` sets and execs for `agent` (a key of AGENTS) against `target`, with the
    agent's own `args` after macserve's settings; `exe` is the CLI's path (its name if None)."""
    if agent not in RULES:
        raise MacserveError(f"unknown agent {agent!r}: one of {', '.join(AGENTS)}")
    return RULES[agent](target, tuple(args), exe or AGENTS[agent].command)


def installed_bin() -> Path:
    """Where scripts/install.sh's pinned CLIs are (its npm prefix's node_modules/.bin)."""
    return env.agents_dir() / "node_modules" / ".bin"


def find(agent: str) -> str:
    """The agent's CLI: on PATH, else the one scripts/install.sh installed; else a one-line
    error saying how to install it."""
    a = AGENTS[agent]
    found = shutil.which(a.command)
    if found:
        return found
    p = installed_bin() / a.command
    if p.is_file() and os.access(p, os.X_OK):
        return str(p)
    raise MacserveError(
        f"{a.command} is not installed: npm i -g {a.package} "
        f"(macserve's tests use {a.package}@{a.version}, from scripts/install.sh)"
    )
