"""`macserve chat`: what it accepts; the body is in cli/chat.py."""

from __future__ import annotations

import click

from ... import env
from ..complete import profile_names
from ..lazy import runs

_BODY = "macserve.cli.chat:"
# macserve/chat.py's (it imports httpx); tests/test_cli_help.py checks that they agree
DEFAULT_MAX_TOKENS = 512


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
@runs(_BODY + "chat")
def chat(target, prompt, system, model, max_tokens, temperature, mtp, api_key, timeout):
    """Chat with TARGET: a profile name, a URL (http://127.0.0.1:8080) or HOST:PORT; with
    one profile, it is the default (`chat "a prompt"` asks it). With PROMPT ('-' reads stdin),
    print one answer and a stats line on stderr, then exit. A profile that is not running is
    started first (or asked through a running router that serves it). Inside: /clear /system
    /stats /save /bye /help."""
