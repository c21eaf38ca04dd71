"""`macserve chat [PROFILE|URL] [PROMPT]`: terminal chat, or one answer for scripts."""

import contextlib
import sys

import click

from .. import env
from ..errors import MacserveError
from .complete import profile_names
from .lazy import lazy
from .services import Waiting

c = lazy("macserve.chat")
health = lazy("macserve.services.health")
service_lifecycle = lazy("macserve.services.lifecycle")
providers = lazy("macserve.services.providers")
routed = lazy("macserve.services.routed")
service_views = lazy("macserve.services.views")
usage = lazy("macserve.services.usage")

HISTORY_LINES = 1000
# macserve/chat.py's (it imports httpx); tests/test_cli_help.py checks that they agree
DEFAULT_MAX_TOKENS = 512


def _readline():
    """readline, for line editing and history in input(), or None where this Python has none."""
    try:
        import readline  # only an interactive chat uses it (its import can touch the terminal)
    except ImportError:  # pragma: no cover
        return None
    return readline


def history_path():
    """The interactive chat's history: lines typed, kept across sessions."""
    return env.home() / "chat_history"


def _router_for(name: str) -> str | None:
    """The URL of a running router that serves profile `name`, if any."""
    for r in routed.live():
        if name in (r.get("models") or {}) and r.get("url"):
            return r["url"]
    return None


def _router_key(url: str) -> str | None:
    port = url.rsplit(":", 1)[-1]
    st = health.store()
    for n in st.names():
        with contextlib.suppress(MacserveError):
            p = st.load(n)
            if providers.for_profile(p).routes and str(p.port) == port:
                return st.load_secrets(n).get("API_KEY")
    return None


def reach(name: str | None) -> tuple[str, str | None, str | None]:
    """(URL, API key, model to send) for a profile: its own port when its server answers; a
    running router that serves it (which starts it, with progress comments); else the
    profile's service is started here, with a progress line, and then its port."""
    url, key = service_lifecycle.endpoint(name)
    c.check_key(key)  # a stored key no client can send: said before anything starts
    if name is None:
        name = health.store().names()[0]
    profile = providers.typed(health.store().load(name))
    prov = providers.for_profile(profile)
    if prov.ready(profile, timeout=2.0):
        usage.touch(name)  # past a router: its idle clock starts again
        return url, key, None
    router = _router_for(name)
    if router is not None:
        click.echo(f"{name} is not running: asking the router at {router}", err=True)
        return router, _router_key(router) or key, name
    click.echo(f"{name} is not running: starting it", err=True)
    w = Waiting(name)
    try:
        out = service_lifecycle.start(name, tick=w)
    finally:
        w.done()
    usage.touch(name)
    click.echo(service_views.outcome_line(name, "started", out.url, out.pid), err=True)
    return url, key, None


@click.command()
@click.argument("target", required=False, shell_complete=profile_names)
@click.argument("prompt", required=False)
@click.option("--system", help="System prompt.")
@click.option("--model", help="Model id to send [default: the server's first /v1/models entry].")
@click.option(
    "--max-tokens",
    type=click.IntRange(1),
    default=DEFAULT_MAX_TOKENS,
    show_default=True,
    help="Answer length limit.",
)
@click.option("--temperature", type=click.FloatRange(0, 2), help="[default: the server's]")
@click.option(
    "--mtp",
    type=click.Choice(["auto", "on", "off"]),
    help="MTP drafting for these answers, asked of a macserve serve (auto: while it measures "
    "that drafting pays) [default: the server's --mtp, auto unless set]; the stats line says "
    "whether it drafted and why.",
)
@click.option(
    "--api-key",
    envvar=env.API_KEY,
    show_envvar=True,
    help="Bearer key [default: the profile's API_KEY].",
)
@click.option(
    "--timeout",
    type=click.FloatRange(1),
    default=600,
    show_default=True,
    help="Seconds to wait for the server between bytes.",
)
def chat(target, prompt, system, model, max_tokens, temperature, mtp, api_key, timeout):
    """Chat with TARGET: a profile name, a URL (http://127.0.0.1:8080) or HOST:PORT. With
    one profile, it is the default (`chat "a prompt"` asks it). With PROMPT ('-' reads stdin),
    print one answer and a stats line on stderr, then exit. A profile that is not running is
    started first (or asked through a running router that serves it). Inside: /clear /system
    /stats /save /bye /help."""
    c.check_key(api_key)  # before a stopped profile is started for it
    url = c.url_of(target) if target else None
    profile_key = used = routed_model = None
    if url is None:
        if target is not None and prompt is None and not service_lifecycle.has_profile(target):
            # `chat "a prompt"`: no profile has that name, so it is the prompt for the only one
            target, prompt = None, target
        url, profile_key, routed_model = reach(target)
        model = model or routed_model
        used = target or health.store().names()[0]
    progress = _Progress()
    client = c.Client(
        url, api_key or profile_key, timeout=timeout, on_note=progress, routed=routed_model
    )
    session = c.Session(client, model or client.model_id(), system, max_tokens, temperature, mtp)

    def write(text):
        progress.clear()
        click.echo(text, nl=False)  # click.echo flushes: each piece shows as it arrives

    if prompt is not None:
        text = sys.stdin.read() if prompt == "-" else prompt
        stats = session.ask(text, write)
        write("\n")
        click.echo(stats.line(), err=True)
        return
    tty = sys.stdin.isatty()
    if tty:
        click.echo(
            f"chatting with {session.model or 'the model'} at {url} (/help for commands)", err=True
        )

    def read():
        if used is not None:
            usage.touch(used)  # each turn: a router's idle clock starts again
        if tty:
            return input("> ")  # input() gives line editing when readline is available
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")

    readline = _readline() if tty else None
    if readline is None:
        c.repl(session, read, write, click.echo)
        return
    hist = history_path()
    with contextlib.suppress(OSError):
        readline.read_history_file(hist)
    readline.set_history_length(HISTORY_LINES)
    try:
        c.repl(session, read, write, click.echo)
    finally:
        with contextlib.suppress(OSError):
            hist.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(hist)


class _Progress:
    """The router's `starting NAME (Ns)` comments on stderr: one line rewritten in place on a
    terminal (cleared when the answer begins), each on its own line otherwise."""

    def __init__(self):
        self.tty = sys.stderr.isatty()
        self.shown = False

    def __call__(self, text: str) -> None:
        text = "router: " + text.removeprefix("macserve router: ")
        if self.tty:
            click.echo(f"\r\033[K{text} ...", nl=False, err=True)
            self.shown = True
        else:
            click.echo(f"{text} ...", err=True)

    def clear(self) -> None:
        if self.shown:
            click.echo("\r\033[K", nl=False, err=True)
            self.shown = False
