"""A profile's service: `run` (what the service runs), `start`, `stop`, `restart`, `logs`, `rm`.
Parsing and printing only; the work is in services/lifecycle.py."""

from __future__ import annotations

import contextlib

import click

from ..errors import MacserveError
from .complete import profile_names
from .lazy import lazy
from .services import TIMEOUT, run_waiting

health = lazy("macserve.services.health")
service_lifecycle = lazy("macserve.services.lifecycle")
service_logs = lazy("macserve.services.supervisors.logs")
service_run = lazy("macserve.services.run")
service_views = lazy("macserve.services.views")
supervisors = lazy("macserve.services.supervisors")
usage = lazy("macserve.services.usage")


@click.command()
@click.argument("name", shell_complete=profile_names)
def run(name):
    """Run a profile's server in the foreground (what the service runs)."""
    service_run.exec_profile(name)


@click.command()
@click.argument("name", shell_complete=profile_names)
@click.option("--no-wait", is_flag=True, help="Do not wait for health.")
@TIMEOUT
def start(name, no_wait, timeout):
    """Install (if needed) and start a profile's service."""
    out = run_waiting(name, service_lifecycle.start, name, timeout=timeout, wait=not no_wait)
    usage.touch(name)  # a running router's idle clock starts again
    what = "already running" if "already running" in out.notes else "started"
    click.echo(service_views.outcome_line(name, what, out.url, out.pid, healthy=not no_wait))


@click.command()
@click.argument("name", shell_complete=profile_names)
def stop(name):
    """Stop a profile's service (it stays stopped until start)."""
    url = health.base_url(health.store().load(name))
    pid = supervisors.get_backend().status(name).pid
    service_lifecycle.stop(name)
    click.echo(service_views.outcome_line(name, "stopped", url, pid))


@click.command()
@click.argument("name", shell_complete=profile_names)
@click.option("--no-wait", is_flag=True, help="Do not wait for health.")
@TIMEOUT
def restart(name, no_wait, timeout):
    """Restart a profile's service (reloading its unit if that changed)."""
    out = run_waiting(name, service_lifecycle.restart, name, timeout=timeout, wait=not no_wait)
    usage.touch(name)
    click.echo(service_views.outcome_line(name, "restarted", out.url, out.pid, healthy=not no_wait))


@click.command()
@click.argument("name", shell_complete=profile_names)
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines.")
@click.option("-n", "lines", type=click.IntRange(0), default=50, show_default=True)
def logs(name, follow, lines):
    """A service's log (server output, plus one line per start)."""
    health.store().load(name)
    path = supervisors.log_path(name)
    if not path.exists():
        raise MacserveError(f"no log yet for {name} ({path})")
    if follow:
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a follow ends
            service_logs.follow(path, lines, click.echo)
        return
    for line in service_logs.tail(path, lines):
        click.echo(line)


@click.command()
@click.argument("name", shell_complete=profile_names)
def rm(name):
    """Stop and uninstall a profile's service, then delete the profile (logs are kept)."""
    service_lifecycle.remove(name)
    click.echo(f"{name}: removed")
