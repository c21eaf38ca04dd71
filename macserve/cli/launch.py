"""`macserve launch AGENT [PROFILE|MODEL] [-- AGENT ARGS]`: a coding agent's CLI (Claude Code,
Codex, opencode) pointed at the router and exec'd.

Parsing and printing only: what each agent is given is services/agents.py's (pure rules);
which router answers (a running one, else the router profile started, else one installed) is
decided here from services.
"""

from __future__ import annotations

import os
import sys

import click

from .. import env
from ..errors import MacserveError
from .complete import profile_names
from .lazy import lazy
from .services import run_waiting

agents = lazy("macserve.services.agents")
create = lazy("macserve.services.create")
health = lazy("macserve.services.health")
service_lifecycle = lazy("macserve.services.lifecycle")
providers = lazy("macserve.services.providers")
routed = lazy("macserve.services.routed")

# services/agents.py's AGENTS and the router's port (tests/test_launch.py checks that they agree)
AGENT_NAMES = ("claude", "codex", "opencode")
ROUTER_PORT = 8000


class _AgentArgs(click.Command):
    """Everything after `--` is the agent's, kept whole (click would otherwise hand its first
    word to the optional PROFILE argument)."""

    def parse_args(self, ctx, args):
        if "--" in args:
            i = args.index("--")
            ctx.meta["launch.args"] = tuple(args[i + 1 :])
            args = args[:i]
        return super().parse_args(ctx, args)


def pick_profile(st, target: str | None):
    """The profile a model name or alias names, or the only profile that serves a model."""
    served = {}
    for n in st.names():
        try:
            p = providers.typed(st.load(n))
        except MacserveError:
            continue  # a broken profile is `ls`'s to report, not a reason to refuse this one
        if providers.for_profile(p).serves_model:
            served[n] = p
    if target is not None:
        for n, p in served.items():
            if target == n or target in p.aliases:
                return p
        raise MacserveError(
            f"no profile or alias {target!r} serves a model here"
            + (f": one of {', '.join(sorted(served))}" if served else " (make one: macserve new)")
        )
    if len(served) != 1:
        raise MacserveError(
            "no profile serves a model yet (make one: macserve new MODEL)"
            if not served
            else f"several profiles ({', '.join(sorted(served))}): name one"
        )
    return next(iter(served.values()))


def router_endpoint(st, name: str, start=True) -> tuple[str, str | None, str]:
    """(URL, key, how) of the router to use: a running one (the one that lists `name` first),
    else the router profile started, else a router installed as a service and started (with
    start=False, as `--print` asks, where it would be). Its key: the router profile's API_KEY,
    else MACSERVE_API_KEY (what a foreground router reads)."""
    routers = {}
    for n in st.names():
        try:
            p = st.load(n)
        except MacserveError:
            continue
        if providers.for_profile(p).routes:
            routers[n] = p

    def key_of(port) -> str | None:
        for n, p in routers.items():
            if p.port == port:
                return st.load_secrets(n).get("API_KEY") or os.environ.get(env.API_KEY)
        return os.environ.get(env.API_KEY) or None

    live = sorted(routed.live(), key=lambda r: name not in (r.get("models") or {}))
    if live:
        return live[0]["url"], key_of(live[0].get("port")), "running"
    if routers:
        rname = sorted(routers)[0]
        if not start:
            return providers.base_url(routers[rname]), key_of(routers[rname].port), "stopped"
        click.echo(f"no router is running: starting {rname}", err=True)
        out = run_waiting(rname, service_lifecycle.start, rname)
        return out.url, key_of(routers[rname].port), "started"
    if not start:
        return f"http://127.0.0.1:{ROUTER_PORT}", key_of(None), "none"
    click.echo("no router yet: installing one as a service (profile router)", err=True)
    out = run_waiting("router", create.new_router, "router")
    click.echo(f"router: routing at {out.url}/v1 (stop it: macserve stop router)", err=True)
    return out.url, key_of(st.load("router").port), "installed"


@click.command(cls=_AgentArgs)
@click.argument("agent", type=click.Choice(AGENT_NAMES))
@click.argument("target", required=False, shell_complete=profile_names)
@click.option(
    "--print",
    "show",
    is_flag=True,
    help="Print what would be set and run (the key masked) instead of running it.",
)
@click.option(
    "--max-output",
    type=click.IntRange(1),
    help="Tokens an answer may take, asked by Claude Code and opencode [default: an eighth of "
    "the profile's CTX, 1,024 to 32,000]; Codex asks for none (the server's default caps it).",
)
@click.pass_context
def launch(ctx, agent, target, show, max_output):
    """Run a coding agent (claude, codex or opencode) against a model served here, through the
    router: the agent's base URL, model name, context window and key are set for that run
    only (environment and `-c` overrides; the key never in argv, nothing written), the router
    started if none runs. TARGET is a profile name or alias (default: the only profile); what
    follows `--` goes to the agent (`macserve launch claude smol -- -p "hi"`)."""
    args = ctx.meta.get("launch.args", ())
    exe = agents.find(agent)
    st = health.store()
    profile = pick_profile(st, target)
    url, key, how = router_endpoint(st, profile.name, start=not show)
    t = agents.Target(url=url, model=profile.name, ctx=profile.ctx, key=key, output=max_output)
    plan = agents.plan(agent, t, args, exe)
    if show:  # starts nothing: says where the router is, or would be
        router = {"running": "the router", "stopped": "the router (stopped: launch starts it)",
                  "none": "a router (none yet: launch installs one)"}[how]  # fmt: skip
        ctx_note = f"context {profile.ctx:,} tokens" if profile.ctx else "no CTX: agent's default"
        click.echo(f"# {agent} through {router} at {url}: model {profile.name}, {ctx_note}")
        for line in plan.shown():
            click.echo(line)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(plan.argv[0], list(plan.argv), plan.environ(os.environ))
