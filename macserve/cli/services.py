"""Service commands: new, worker, set, run, ls, show, start, stop, restart, status, logs,
rm.

Parsing and printing only; the work is in services/manager.py.
Each command's arguments, options and help: cli/commands/services.py.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sys

import click

from ..errors import MacserveError
from ..services import manager, usage
from ..services import pull as hub
from ..services.doctor import doctor as doctor_report
from ..services.run import exec_profile
from ..services.supervisors import log_path
from ..services.supervisors import logs as service_logs
from ..services.views import outcome_line
from ..sizing.budget import parse_size
from .fmt import context as _context
from .fmt import size as _size


class Waiting:
    """Progress while a service loads: a spinner on a terminal, one line otherwise."""

    def __init__(self, name: str):
        self.name = name
        self.tty = sys.stderr.isatty()
        self.spin = itertools.cycle("|/-\\")
        self.said = False

    def __call__(self, elapsed: float, status) -> None:
        if self.tty:
            click.echo(
                f"\r{next(self.spin)} waiting for {self.name} to become healthy "
                f"({status.state}, {elapsed:.0f}s) ",
                nl=False,
                err=True,
            )
        elif not self.said:
            click.echo(f"waiting for {self.name} to become healthy ...", err=True)
            self.said = True

    def done(self) -> None:
        if self.tty:
            click.echo("\r\033[K", nl=False, err=True)


def _run_waiting(label, fn, *args, **kw):
    w = Waiting(label)
    try:
        return fn(*args, tick=w, **kw)
    except manager.SetFailed as e:
        w.done()
        if e.log_tail:
            click.echo(f"--- last lines of {label}'s log with the failed settings ---", err=True)
            for line in e.log_tail:
                click.echo(f"  {line}", err=True)
            click.echo("---", err=True)
        raise
    finally:
        w.done()


def _read_secret(key: str) -> str:
    """A secret from stdin: prompted without echo on a terminal, else the first line."""
    if sys.stdin.isatty():
        return click.prompt(key, hide_input=True, err=True)
    return sys.stdin.readline().strip()


def pull_model(source, quant):
    """`new`'s download step: `pull` with progress on stderr; the local path to serve."""
    click.echo(f"pulling {source} ...", err=True)
    return hub.pull(source, quant).model_path


def _ctx(value):
    if value is None or value == "auto":
        return "auto"
    if not value.isdigit() or int(value) < 1:
        raise click.BadParameter("a positive number of tokens, or auto")
    return int(value)


def new(source, quant, name, provider, ctx, kv, port, host, extra_args, no_start, timeout, api_key):
    ctx = _ctx(ctx)
    if api_key == "-":
        api_key = _read_secret("API_KEY")
    nm = name or manager.default_name(source, quant)
    out = _run_waiting(
        nm,
        manager.new,
        source,
        quant=quant,
        name=name,
        provider=provider,
        ctx=ctx,
        port=port,
        host=host,
        extra_args=extra_args,
        start=not no_start,
        timeout=timeout,
        api_key=api_key,
        pull=pull_model,
        kv=kv,
    )
    for n in out.notes:
        click.echo(f"note: {n}", err=True)
    if no_start:
        click.echo(f"{out.name}: profile written; start it with: macserve start {out.name}")
    else:
        click.echo(outcome_line(out.name, "started", out.url, out.pid))


def worker(name, host, port, extra_args, no_start, timeout):
    out = _run_waiting(
        name,
        manager.new_worker,
        name,
        host,
        port=port,
        extra_args=extra_args,
        start=not no_start,
        timeout=timeout,
    )
    if no_start:
        click.echo(f"{out.name}: profile written; start it with: macserve start {out.name}")
    else:
        click.echo(
            f"{out.name}: rpc worker listening on {out.url} (pid {out.pid}); on the head: "
            f"macserve set PROFILE -- HOSTS={out.url} BACKEND=rpc"
        )


def set_(name, items, no_restart, timeout):
    changes = manager.parse_assignments(items)
    secrets = {k: (_read_secret(k) if v == "-" else v) for k, v in changes.secrets.items()}
    changes = manager.Changes(changes.values, secrets, changes.add_args, changes.drop_args)
    st = manager.store()
    before = st.text(name)
    try:
        out = _run_waiting(
            name, manager.set_values, name, changes, restart=not no_restart, timeout=timeout
        )
    except KeyboardInterrupt:
        # Before the restart (the checks: a server's --help, ssh): nothing was written. Once
        # the restart is under way, set's own handler rolls back and says so (SetFailed).
        if st.text(name) == before:
            raise MacserveError(f"interrupted: nothing changed ({name} is as it was)") from None
        raise MacserveError(
            f"interrupted while saving: the next macserve command puts {name} back"
        ) from None
    for n in out.notes:
        click.echo(f"{name}: {n}")
    if out.pid:
        click.echo(outcome_line(name, "restarted", out.url, out.pid))


def pull(source, quant):
    p = hub.pull(source, quant)
    click.echo(f"{p.repo}{':' + p.quant if p.quant else ''}: {p.model_path}")


def parse_args(ctx, command, args):
    cmd = ctx.find_root().command.get_command(ctx, command)
    if cmd is None:
        raise MacserveError(f"no command {command!r}")
    what = f"macserve {command}"
    try:
        cmd.make_context(what, list(args))
    except click.NoSuchOption as e:
        raise MacserveError(
            f"{what} does not accept {e.option_name} (checked by its parser)"
        ) from None
    except click.BadOptionUsage as e:
        if "requires an argument" in e.message:
            raise MacserveError(f"{e.option_name} expects a value") from None
        raise MacserveError(f"{what}: {e.format_message()}") from None
    except click.ClickException as e:
        raise MacserveError(f"{what}: {e.format_message()}") from None


def run(name):
    exec_profile(name)


def start(name, no_wait, timeout):
    out = _run_waiting(name, manager.start, name, timeout=timeout, wait=not no_wait)
    usage.touch(name)  # a running router's idle clock starts again
    what = "already running" if "already running" in out.notes else "started"
    click.echo(outcome_line(name, what, out.url, out.pid, healthy=not no_wait))


def stop(name):
    url = manager.base_url(manager.store().load(name))
    pid = manager.get_backend().status(name).pid
    manager.stop(name)
    click.echo(outcome_line(name, "stopped", url, pid))


def restart(name, no_wait, timeout):
    out = _run_waiting(name, manager.restart, name, timeout=timeout, wait=not no_wait)
    usage.touch(name)
    click.echo(outcome_line(name, "restarted", out.url, out.pid, healthy=not no_wait))


def doctor(as_json, memory):
    rep = doctor_report(parse_size(memory) if memory else None)
    if as_json:
        click.echo(json.dumps(rep.to_dict(), indent=2))
        return
    limit = (
        "not a Mac"
        if rep.wired_limit_mb is None
        else f"iogpu.wired_limit_mb={rep.wired_limit_mb}"
        + (" (macOS default)" if rep.wired_limit_mb == 0 else "")
    )
    click.echo(f"memory:   {_size(rep.total_memory_bytes)} RAM; {limit}")
    click.echo(f"budget:   {_size(rep.budget_bytes)} for the GPU ({rep.budget_source})")
    if rep.profiles:
        head = ["PROFILE", "STATE", "AT LOGIN", "CONTEXT", "CACHE", "WEIGHTS", "KV", "TOTAL"]
        lines = [head]
        for p in rep.profiles:
            lines.append(
                [
                    p["name"],
                    p["state"],
                    "yes" if p["at_login"] else "no",
                    _context(p["ctx"]),
                    p["cache_key"] or "-",
                    _size(p["weights_bytes"]),
                    _size(p["cache_bytes"]),
                    _size(p["total_bytes"]),
                ]
            )
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        for line in lines:
            click.echo("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
        for p in rep.profiles:
            for why in filter(None, (p["error"], p["note"])):
                click.echo(f"  {p['name']}: {why}")
    verdict = "fits" if rep.fits else "DOES NOT FIT"
    click.echo(f"at login: {_size(rep.at_login_bytes)} of {_size(rep.budget_bytes)}: {verdict}")
    if not rep.fits:  # the sysctl only when something does not fit
        click.echo(
            f"raise:    {rep.raise_command}  (RAM less 8 GB, at least the default; until reboot; "
            f"to keep it: {rep.persist})"
        )
    for n in rep.notes:
        click.echo(f"note: {n}")


def logs(name, follow, lines):
    manager.store().load(name)
    path = log_path(name)
    if not path.exists():
        raise MacserveError(f"no log yet for {name} ({path})")
    if follow:
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a follow ends
            service_logs.follow(path, lines, click.echo)
        return
    for line in service_logs.tail(path, lines):
        click.echo(line)


def rm(name):
    manager.remove(name)
    click.echo(f"{name}: removed")
