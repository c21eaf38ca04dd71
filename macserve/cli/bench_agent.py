"""`bench agent`: a coding agent's recorded loop replayed through the router against macserve's
engine and llama-server, cached tokens and time to first token per turn (issue 44 item 6;
docs/agents.md). The recording (`--record`) and the replay are dev/agent_capture.py's and
dev/agent_loop.py's; here, the agents run and the servers behind a router are set up."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from .. import env
from .launch import AGENT_NAMES  # the agents `launch` sets up
from .lazy import lazy

agent_capture = lazy("macserve.dev.agent_capture")
agent_loop = lazy("macserve.dev.agent_loop")
agents = lazy("macserve.services.agents")
gguf_twin = lazy("macserve.dev.gguf_twin")
llama_cpp = lazy("macserve.services.providers.llama_cpp")
smollm = lazy("macserve.dev.smollm")
supervisord = lazy("macserve.services.supervisors.supervisord")

PROVIDERS = ("engine", "llama")
CTX = 32768  # an agent's first turn is 15-20K tokens (docs/agents.md)
# llama-server's YaRN: SmolLM2's 8,192 trained positions stretched 4x (as tests/test_agents_e2e.py)
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
YARN_FLAGS = "--rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 8192"
PROMPT = "Read prompt_cache.py and explain how the prompt cache evicts entries."
# the files the scripted tool calls read (agent_capture.SCRIPT), copied into the agent's folder
WORK_FILES = (
    "server/prompt_cache.py",
    "server/scheduler.py",
    "server/disk_blocks.py",
    "server/worker.py",
)


def recorded_dir() -> Path:
    """Where `--record` keeps the agents' requests: the user's cache, never the repository
    (they hold the agents' own system prompts and tool schemas)."""
    return env.agents_dir() / "recorded"


def _agent_args(agent: str, work: Path) -> tuple[str, ...]:
    """Headless, allowed to run the scripted tools without asking."""
    if agent == "claude":
        return ("-p", PROMPT, "--allowedTools", "Bash,Read")
    if agent == "codex":
        return (
            "exec",
            "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox",
            PROMPT,
        )
    (work / "opencode.json").write_text(
        json.dumps({"permission": {"bash": "allow", "read": "allow"}})
    )
    return ("run", PROMPT)


def record(agent: str, out: Path) -> int:
    """Run the agent against the recording stand-in; the number of loop turns it made."""
    pkg = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="macserve-record-") as tmp:
        work, home = Path(tmp) / "work", Path(tmp) / "home"
        work.mkdir()
        home.mkdir()
        for f in WORK_FILES:
            shutil.copy(pkg / f, work / Path(f).name)
        shutil.copy(pkg.parent / "README.md", work / "README.md")
        if out.exists():
            shutil.rmtree(out)
        with agent_capture.Capture(agent, out, work, "smol") as cap:
            target = agents.Target(cap.url, "smol", CTX, None, 1024)
            plan = agents.plan(agent, target, _agent_args(agent, work), agents.find(agent))
            variables = plan.environ(os.environ)
            # the agent's own config and state out of the user's (and the user's out of it)
            variables.update(HOME=str(home), PWD=str(work), OPENCODE_DISABLE_MODELS_FETCH="1")
            for k in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "CODEX_HOME"):
                variables.pop(k, None)
            p = subprocess.run(
                plan.argv, cwd=work, env=variables, capture_output=True, text=True,
                timeout=600, stdin=subprocess.DEVNULL,
            )  # fmt: skip
            if p.returncode != 0:
                raise click.ClickException(f"{agent} exited {p.returncode}: {p.stderr[-800:]}")
            return cap.turn


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stretched_twin(twin: Path, out: Path) -> Path:
    """The MLX twin with YaRN's 4x stretch in its config (the same as llama-server's flags);
    its weights linked, not copied."""
    out.mkdir(parents=True)
    for f in twin.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f.resolve())
    cfg = json.loads((twin / "config.json").read_text())
    cfg["rope_scaling"], cfg["max_position_embeddings"] = YARN, CTX
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def write_profile(home: Path, provider: str, twin: Path | None) -> str:
    """A profile of SmolLM2 at CTX on `provider` in `home`; its name."""
    (home / "profiles").mkdir(parents=True, exist_ok=True)
    port = _free_port()
    if provider == "engine":
        model = stretched_twin(twin, home / "smol-yarn")
        # a first turn of 12-20K tokens takes over the server's 600 s request timeout at this
        # machine's 15-45 tokens/s (which cuts it off unanswered, and caches nothing).
        # No MEMORY: the router's default share, which counts the engine's float32 caches on
        # this CPU (sizing/host.py), so its prompt cache holds a whole-context sequence.
        text = f"PROVIDER=macserve\nMODEL={model}\nCTX={CTX}\nEXTRA_ARGS='--request-timeout 7200'\n"
    else:
        template = home / "chatml-tools.jinja"
        template.write_text(agent_loop.CHATML_TOOLS)
        extra = f"-t 2 --temp 0 {YARN_FLAGS} --jinja --chat-template-file {template}"
        text = f"PROVIDER=llama.cpp\nMODEL={smollm.gguf_path()}\nCTX={CTX}\nEXTRA_ARGS='{extra}'\n"
    (home / "profiles" / f"{provider}.env").write_text(text + f"HOST=127.0.0.1\nPORT={port}\n")
    return provider


@contextlib.contextmanager
def router(home: Path):
    """A router in the foreground over `home`'s profiles (supervisord starts them on demand);
    at the end, the router stopped and supervisord shut down with every server it ran."""
    import httpx  # 0.3 s: only a replay needs it, never `bench --help`

    port = _free_port()
    variables = dict(
        os.environ,
        MACSERVE_HOME=str(home),
        MACSERVE_SERVICE_BACKEND="supervisor",
        PYTHONUNBUFFERED="1",
    )
    variables.setdefault("MACSERVE_LLAMA_SERVER", llama_cpp.find_llama_server())
    log = open(home / "router.log", "w")  # noqa: SIM115 - closed below, after the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "macserve", "router", "--port", str(port), "--ttl", "3600s"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=variables,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise click.ClickException(
                    f"the router exited: {(home / 'router.log').read_text()[-800:]}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()
        supervisord.SupervisorBackend(home).shutdown()


def warm(url: str, model: str) -> None:
    """The model started (the router starts it on its first request) before turn 1 is timed."""
    import httpx  # 0.3 s: only a replay needs it, never `bench --help`

    body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    if r.status_code != 200:
        raise click.ClickException(f"{model} did not start: {r.status_code} {r.text[:400]}")


def _header(agent: str, provider: str) -> None:
    click.echo(f"\n{agent} on {provider}")
    click.echo(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'cached %':>8} {'new':>6} {'TTFT s':>7}")


def _row(r) -> None:
    click.echo(
        f"{r.turn:>4} {r.prompt:>7,} {r.cached:>7,} {r.share:>8.1%} {r.prompt - r.cached:>6,} "
        f"{r.ttft:>7.1f}"
    )


def _summary(rows: list) -> None:
    later = rows[1:]
    if later:
        worst = min(later, key=lambda r: r.share)
        click.echo(
            f"turns 2-{rows[-1].turn}: least cached {worst.share:.1%} (turn {worst.turn}); "
            f"TTFT {sum(r.ttft for r in later) / len(later):.1f} s on average against "
            f"{rows[0].ttft:.1f} s for turn 1"
        )


def reuse_report(agent: str, turns: list) -> None:
    """What changes between consecutive recorded requests before their common end."""
    changes = [
        (n, c)
        for n, (a, b) in enumerate(zip(turns, turns[1:]), 1)
        if (c := agent_loop.first_change(a.body, b.body))
    ]
    if not changes:
        click.echo(
            f"{agent}: every recorded turn extends the one before (nothing rendered changes)"
        )
    for n, c in changes:
        click.echo(
            f"{agent}: turn {n + 1} changes {c} of turn {n}: the cache can reuse only what precedes it"
        )


@click.command("agent")
@click.option(
    "--agent",
    "agent_names",
    type=click.Choice(AGENT_NAMES),
    multiple=True,
    help="[default: all three]",
)
@click.option(
    "--provider",
    "provider_names",
    type=click.Choice(PROVIDERS),
    multiple=True,
    help="[default: both]",
)
@click.option(
    "--record",
    "do_record",
    is_flag=True,
    help="Record the agents' requests first (runs their CLIs against a scripted stand-in).",
)
@click.option("--no-replay", is_flag=True, help="With --record: record only.")
@click.option(
    "--recordings",
    type=click.Path(file_okay=False, path_type=Path),
    help="[default: ~/.cache/macserve/agents/recorded]",
)
@click.option("--turns", type=click.IntRange(1), default=10, show_default=True)
@click.option(
    "--max-tokens",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="Tokens each answer may take (the prompt is what is measured: its first token ends "
    "the prefill).",
)
@click.option(
    "--twin",
    "twin_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="SmolLM2's MLX twin (`macserve dev twin`) [default: converted into a temporary folder].",
)
@click.option("--url", help="A running router to use instead (its profiles named by --model).")
@click.option("--model", "model_name", help="With --url: the profile to replay against.")
@click.option("--json", "as_json", is_flag=True)
def bench_agent(agent_names, provider_names, do_record, no_replay, recordings, turns, max_tokens, twin_dir, url, model_name, as_json):  # fmt: skip
    """A coding agent's loop (its recorded requests: system prompt, tools, ten turns with tool
    results) replayed through the router against the engine and llama-server: prompt tokens,
    cached tokens and time to first token per turn."""
    # a SIGTERM ends the run through the `finally`s: its router and servers stopped with it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    agent_names = agent_names or AGENT_NAMES
    provider_names = provider_names or PROVIDERS
    folder = recordings or recorded_dir()
    if do_record:
        for a in agent_names:
            n = record(a, folder / a)
            click.echo(f"recorded {a}: {n} turns in {folder / a}", err=True)
        if no_replay:
            return
    loops = {}
    for a in agent_names:
        if not (folder / a).is_dir():
            raise click.ClickException(f"no recording of {a} in {folder}: run with --record first")
        loops[a] = agent_loop.load(folder / a)[:turns]
        if not as_json:
            reuse_report(a, loops[a])
    out = []

    def run(url: str, model: str, provider: str) -> None:
        for a, loop in loops.items():
            rows = []
            if not as_json:
                _header(a, provider)
            for r in agent_loop.replay(url, model, loop, max_tokens):
                rows.append(r)
                if not as_json:
                    _row(r)  # as it comes: a turn of a long prompt takes minutes here
            out.append({"agent": a, "provider": provider, "turns": [r.__dict__ for r in rows]})
            if not as_json:
                _summary(rows)

    if url:
        if not model_name:
            raise click.UsageError("--url needs --model (the profile to replay against)")
        run(url.rstrip("/"), model_name, model_name)
    else:
        with tempfile.TemporaryDirectory(prefix="macserve-bench-agent-") as tmp:
            if "engine" in provider_names and twin_dir is None:
                twin_dir = gguf_twin.convert(
                    smollm.gguf_path(), Path(tmp) / "twin", gguf_twin.default_dtype()
                )
            for p in provider_names:
                # one provider at a time, each behind its own router: the other's server is
                # not holding memory or CPU while this one is timed
                home = Path(tmp) / p
                name = write_profile(home, p, twin_dir)
                with router(home) as u:
                    warm(u, name)
                    run(u, name, p)
    if as_json:
        click.echo(json.dumps(out, indent=1))
