"""`macserve ls`, `status` and `show`: what the services are doing, as a table or JSON; and
`doctor`: whether those that start at login fit the GPU memory. Parsing and printing only; the
rows are services/views.py's, the memory check services/doctor.py's."""

from __future__ import annotations

import json
import shlex

import click

from .complete import profile_names
from .fmt import age as _age
from .fmt import context as _context
from .fmt import short_size as _mem
from .fmt import size as _size
from .lazy import lazy

budget = lazy("macserve.sizing.budget")
health = lazy("macserve.services.health")
service_views = lazy("macserve.services.views")
service_doctor = lazy("macserve.services.doctor")
supervisors = lazy("macserve.services.supervisors")


def _seconds(s: float) -> str:
    """A TTL as written: 90s, 10m, 1.5h."""
    for unit, n in (("h", 3600), ("m", 60)):
        if s >= n and (s / n) * 10 == int((s / n) * 10):
            return f"{s / n:g}{unit}"
    return f"{s:g}s"


def _routed(r) -> str:
    """Which running router serves the profile, and its TTL there."""
    parts = []
    for x in r.get("routed") or []:
        port = (x.get("router") or "").rsplit(":", 1)[-1]
        ttl = "always on" if x.get("ttl_s") is None else f"ttl {_seconds(x['ttl_s'])}"
        parts.append(f":{port} {ttl}")
    return ", ".join(parts) or "-"


def _table(rows, health=False):
    routed = any(r.get("routed") for r in rows)
    head = (
        ["NAME", "PROVIDER", "STATE", "PID", "PORT", "UPTIME", "MEM"]
        + (["HEALTHY"] if health else [])
        + (["ROUTER"] if routed else [])
        + ["MODEL"]
    )
    lines = [head]
    for r in rows:
        state = r["state"] if not r.get("error") else "invalid"
        line = [
            r["name"],
            r["provider"] or "-",
            state,
            str(r["pid"] or "-"),
            str(r["port"] or "-"),
            _age(r["uptime_s"]),
            _mem(r["rss_bytes"]),
        ]
        if health:
            line.append("yes" if r.get("healthy") else "no")
        if routed:
            line.append(_routed(r))
        line.append(r["model"] or (r.get("error") or "-"))
        lines.append(line)
    widths = [max(len(l[i]) for l in lines) for i in range(len(head) - 1)]
    for l in lines:
        click.echo("  ".join(c.ljust(w) for c, w in zip(l, widths)) + "  " + l[-1])


@click.command(name="ls")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def ls(as_json):
    """Profiles with their service state, pid, port, uptime and memory."""
    rows = service_views.rows()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    elif not rows:
        click.echo("no profiles (create one with: macserve new MODEL)")
    else:
        _table(rows)
    _journal_notes(rows)


def _journal_notes(rows) -> None:
    for r in rows:
        if r.get("journal"):
            click.echo(f"note: {r['journal']}", err=True)
        if r.get("state") in ("crash-loop", "orphaned"):
            click.echo(f"note: {r['name']}: {r['state']}: {r['detail']}", err=True)


@click.command()
@click.argument("name", required=False, shell_complete=profile_names)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(name, as_json):
    """Service state plus a live health probe, for one profile or all."""
    if name is not None:
        health.store().load(name)  # unknown name (or ""): one-line error
    rows = (
        [service_views.row(name, health=True)]
        if name is not None
        else service_views.rows(health=True)
    )
    if as_json:
        click.echo(json.dumps({"backend": supervisors.backend_name(), "services": rows}, indent=2))
        return
    click.echo(f"backend: {supervisors.backend_name()}")
    if rows:
        _table(rows, health=True)
    _journal_notes(rows)


@click.command()
@click.argument("name", shell_complete=profile_names)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def show(name, as_json):
    """A profile: its file, the exact server command, and its service."""
    r = service_views.show(name)
    if as_json:
        click.echo(json.dumps(r, indent=2))
        return
    click.echo(f"# {r['file']}")
    click.echo(r["text"].rstrip("\n"))
    for key, names in r["secrets"].items():
        given = f"the server's {', '.join(names)}" if names else "not used by this provider"
        click.echo(f"# secret:  {key} set, in {r['secrets_file']} (mode 0600; {given})")
    click.echo(f"# command: {shlex.join(r['argv'])}")
    click.echo(f"# health:  {r['health_url']}")
    click.echo(
        f"# service: {r['backend']}: {r['state']}" + (f", pid {r['pid']}" if r["pid"] else "")
    )
    click.echo(f"# log:     {r['log']}")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--memory", help="Check for a Mac with this much RAM (e.g. 192GB), not this one.")
def doctor(as_json, memory):
    """Do the services that start at login fit the GPU memory?

    The wired limit and RAM, each profile's weights + cache at its context (inspect's
    figures), and the sysctl to raise it."""
    rep = service_doctor.doctor(budget.parse_size(memory) if memory else None)
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
