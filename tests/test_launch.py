"""`macserve launch`'s rules, without processes: what each agent is given (services/agents.py's
`plan`), the key kept out of argv and masked by `--print`, Codex's overrides valid TOML that
make one provider table, the context each agent is told, and the command's choice of profile
and router (`--print` through click's runner, which starts nothing)."""

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from macserve.cli import launch as cli_launch
from macserve.cli import main
from macserve.cli import router as cli_router
from macserve.errors import MacserveError
from macserve.services import agents
from macserve.services.health import store

KEY = "sk-secret-1234"
URL = "http://127.0.0.1:8000"


def target(ctx=32768, key=KEY):
    return agents.Target(url=URL, model="smol", ctx=ctx, key=key)


@pytest.mark.parametrize("agent", sorted(agents.AGENTS))
def test_the_key_is_never_in_argv_and_print_masks_it(agent):
    p = agents.plan(agent, target(), ("-p", "hi"))
    assert not any(KEY in a for a in p.argv)
    assert KEY in p.environ({}).values()
    assert p.argv[-2:] == ("-p", "hi")  # the agent's own arguments last, untouched
    shown = "\n".join(p.shown())
    assert KEY not in shown and "****" in shown


@pytest.mark.parametrize("agent", sorted(agents.AGENTS))
def test_without_a_key_none_is_inherited(agent):
    """A MACSERVE_API_KEY in the caller's environment for some other server is not passed on
    when the router wants none, nor a real Anthropic key to Claude Code (which gets a
    placeholder: it asks to log in without one)."""
    p = agents.plan(agent, target(key=None))
    e = p.environ({agents.KEY_VAR: "other", "ANTHROPIC_API_KEY": "sk-ant-real"})
    assert "other" not in e.values()
    assert agent != "claude" or "sk-ant-real" not in e.values()
    assert p.secrets == frozenset()


def test_claude_code_is_told_the_url_the_model_and_the_context():
    e = agents.plan("claude", target(ctx=32768)).env
    assert e["ANTHROPIC_BASE_URL"] == URL and e["ANTHROPIC_AUTH_TOKEN"] == KEY
    for k in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL"):
        assert e[k] == "smol"
    # under Claude Code's 100K floor for a compaction window: the window as the context
    assert e["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "32768" and e["DISABLE_COMPACT"] == "1"
    assert "CLAUDE_CODE_AUTO_COMPACT_WINDOW" not in e
    assert int(e["CLAUDE_CODE_MAX_OUTPUT_TOKENS"]) < 32768  # its default 32,000 would fill it
    big = agents.plan("claude", target(ctx=131072)).env
    assert big["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == "131072"
    assert "DISABLE_COMPACT" not in big and "CLAUDE_CODE_MAX_CONTEXT_TOKENS" not in big
    asked = agents.Target(url=URL, model="smol", ctx=32768, key=None, output=48)
    assert agents.plan("claude", asked).env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "48"
    c = json.loads(agents.plan("opencode", asked).env["OPENCODE_CONFIG_CONTENT"])
    assert c["provider"]["macserve"]["models"]["smol"]["limit"]["output"] == 48
    none = agents.plan("claude", target(ctx=None)).env
    assert not {"CLAUDE_CODE_AUTO_COMPACT_WINDOW", "CLAUDE_CODE_MAX_OUTPUT_TOKENS"} & set(none)


def test_codex_overrides_are_toml_and_make_a_responses_provider():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11's; macserve runs on 3.10 too
    p = agents.plan("codex", target(), ("exec", "hi"), exe="/x/codex")
    argv = list(p.argv)
    assert argv[0] == "/x/codex" and argv[-2:] == ["exec", "hi"]
    config: dict = {}
    for i, a in enumerate(argv[:-2]):
        if a == "-c":
            for k, v in tomllib.loads(argv[i + 1]).items():  # `a.b=v` is TOML's dotted key
                _merge(config, {k: v})
    prov = config["model_providers"]["macserve"]
    assert config["model_provider"] == "macserve" and config["model"] == "smol"
    assert prov["base_url"] == URL + "/v1" and prov["wire_api"] == "responses"
    assert p.env[prov["env_key"]] == KEY  # the key by name, its value in the environment
    assert config["model_context_window"] == 32768
    assert 0 < config["model_auto_compact_token_limit"] < 32768


def _merge(a: dict, b: dict) -> None:
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(a.get(k), dict):
            _merge(a[k], v)
        else:
            a[k] = v


def test_opencode_gets_an_openai_compatible_provider_with_the_context():
    p = agents.plan("opencode", target())
    c = json.loads(p.env["OPENCODE_CONFIG_CONTENT"])
    prov = c["provider"]["macserve"]
    assert prov["npm"] == "@ai-sdk/openai-compatible"
    assert prov["options"] == {"baseURL": URL + "/v1", "apiKey": "{env:MACSERVE_API_KEY}"}
    assert prov["models"]["smol"]["limit"]["context"] == 32768
    assert c["model"] == c["small_model"] == "macserve/smol"
    assert KEY not in p.env["OPENCODE_CONFIG_CONTENT"]


def test_the_declarations_agree_with_the_rules():
    assert cli_launch.AGENT_NAMES == tuple(agents.AGENTS)
    assert cli_launch.ROUTER_PORT == cli_router.ROUTER_PORT


def test_a_missing_agent_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("MACSERVE_AGENTS", str(tmp_path / "agents"))
    with pytest.raises(MacserveError, match=r"npm i -g @openai/codex"):
        agents.find("codex")
    bin_dir = tmp_path / "agents" / "node_modules" / ".bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "codex").write_text("#!/bin/sh\n")
    os.chmod(bin_dir / "codex", 0o755)
    assert agents.find("codex") == str(bin_dir / "codex")


def _profile(home, name, port, extra=""):
    (home / "profiles").mkdir(exist_ok=True)
    (home / "profiles" / f"{name}.env").write_text(
        f"PROVIDER=llama.cpp\nMODEL=/models/{name}.gguf\nHOST=127.0.0.1\nPORT={port}\n"
        f"CTX=32768\n{extra}"
    )


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """An executable named claude where install.sh puts it (found, never run: --print)."""
    monkeypatch.setenv("MACSERVE_AGENTS", str(tmp_path / "agents"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    b = tmp_path / "agents" / "node_modules" / ".bin"
    b.mkdir(parents=True)
    (b / "claude").write_text("#!/bin/sh\n")
    os.chmod(b / "claude", 0o755)
    return b / "claude"


def test_print_names_the_profile_by_alias_and_masks_the_key(macserve_home, installed, monkeypatch):
    _profile(macserve_home, "smol", 8101, "ALIASES=tiny-chat\n")
    _profile(macserve_home, "other", 8102)
    monkeypatch.setenv("MACSERVE_API_KEY", KEY)
    r = CliRunner().invoke(main, ["launch", "claude", "tiny-chat", "--print", "--", "-p", "hi"])
    assert r.exit_code == 0, r.output
    assert "model smol, context 32,768 tokens" in r.output
    assert "none yet: launch installs one" in r.output  # no router runs: --print starts none
    assert "ANTHROPIC_MODEL=smol" in r.output and "ANTHROPIC_AUTH_TOKEN=****" in r.output
    assert KEY not in r.output
    assert r.output.rstrip().endswith(f"{installed} -p hi")
    r = CliRunner().invoke(main, ["launch", "claude", "--print"])
    assert r.exit_code == 2 and "several profiles (other, smol): name one" in r.output
    r = CliRunner().invoke(main, ["launch", "claude", "nope", "--print"])
    assert r.exit_code == 2 and "no profile or alias 'nope'" in r.output


def test_install_sh_pins_the_versions_the_rules_name():
    """scripts/install.sh installs what services/agents.py says the tests run."""
    text = (Path(__file__).resolve().parent.parent / "scripts" / "install.sh").read_text()
    line = next(x for x in text.splitlines() if x.strip().startswith("specs="))
    pinned = line.split("=", 1)[1].strip().strip('"').split()
    assert pinned == [f"{a.package}@{a.version}" for a in agents.AGENTS.values()]


def test_print_uses_the_router_profile_and_its_key(macserve_home, installed):
    """A stopped router profile is the one launch would start; its own API_KEY is the key."""
    _profile(macserve_home, "smol", 8101)
    (macserve_home / "profiles" / "gate.env").write_text(
        "PROVIDER=router\nHOST=127.0.0.1\nPORT=8123\nEXTRA_ARGS=''\n"
    )
    store().save_secrets("gate", {"API_KEY": KEY})
    r = CliRunner().invoke(main, ["launch", "claude", "--print"])
    assert r.exit_code == 0, r.output
    assert "through the router (stopped: launch starts it) at http://127.0.0.1:8123" in r.output
    assert "ANTHROPIC_AUTH_TOKEN=****" in r.output and KEY not in r.output
