"""`macserve chat [PROFILE|URL] [PROMPT]`: terminal chat, or one answer for scripts."""

import sys

import click

from .. import chat as c
from .. import env
from ..services import manager


@click.command()
@click.argument("target", required=False)
@click.argument("prompt", required=False)
@click.option("--system", help="System prompt.")
@click.option("--model", help="Model id to send [default: the server's first /v1/models entry].")
@click.option(
    "--max-tokens", type=click.IntRange(1), help="Answer length limit [default: the server's]."
)
@click.option("--temperature", type=click.FloatRange(0, 2), help="[default: the server's]")
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
def chat(target, prompt, system, model, max_tokens, temperature, api_key, timeout):
    """Chat with TARGET: a profile name, a URL (http://127.0.0.1:8080) or HOST:PORT; with
    one profile, it is the default (`chat "a prompt"` asks it). With PROMPT ('-' reads stdin),
    print one answer and a stats line on stderr, then exit. Inside: /clear /system /stats
    /save /exit /help."""
    url = c.url_of(target) if target else None
    profile_key = None
    if url is None:
        if target is not None and prompt is None and not manager.has_profile(target):
            # `chat "a prompt"`: no profile has that name, so it is the prompt for the only one
            target, prompt = None, target
        url, profile_key = manager.endpoint(target)
    client = c.Client(url, api_key or profile_key, timeout=timeout)
    session = c.Session(client, model or client.model_id(), system, max_tokens, temperature)

    def write(text):
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
        if tty:
            return input("> ")  # input() gives line editing when readline is available
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")

    c.repl(session, read, write, click.echo)
