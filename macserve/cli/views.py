"""`macserve ls`, `status` and `show`: what the services are doing, as a table or JSON; and
`doctor`: whether those that start at login fit the GPU memory. Each says the same memory
ledger (`ledger_lines`, also `inspect NAME`'s): a profile's share and its parts, what its
server holds now and at its peak, the budget and free memory. Parsing and printing only; the
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
        ["NAME", "PROVIDER", "STATE", "PID", "PORT", "UPTIME", "MEM", "PEAK", "SHARE"]
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
            _mem(r.get("resident_bytes") or r["rss_bytes"]),
            _mem(r.get("peak_bytes")),
            _mem(r.get("share_bytes")),
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


def machine_line(m: dict, counted: int | None = None) -> str:
    """The budget, its source, and what the machine has free now."""
    held = f"; {_size(counted)} counted in shares now" if counted is not None else ""
    return (
        f"budget:   {_size(m['budget_bytes'])} ({m['budget_source']}){held}; free on this "
        f"machine now {_size(m['free_bytes'])} of {_size(m['total_bytes'])}"
    )


def share_parts(sh: dict) -> str:
    """A share's parts: weights + KV x PARALLEL + prompt cache + baseline + reserve."""
    if sh.get("memory_bytes") is not None and sh.get("weights_bytes") is None:
        return f"MEMORY={_size(sh['memory_bytes'])} set by hand"
    seqs = f"{sh['parallel']} sequence" + ("s" if sh["parallel"] != 1 else "")
    return (
        f"weights {_size(sh['weights_bytes'])} + KV {_size(sh['kv_bytes'])} x {seqs} + prompt "
        f"cache {_size(sh['prompt_cache_bytes'])} + baseline {_size(sh['baseline_bytes'])} + "
        f"reserve {_size(sh['reserve_bytes'])}"
    )


def ledger_lines(r: dict) -> list[str]:
    """One profile's ledger (a views row), the same in `inspect NAME` and `doctor`."""
    sh, res = r.get("share"), r.get("resident") or {}
    out = []
    if not sh:
        out.append("share:    n/a")
    elif sh.get("share_bytes") is None:
        out.append(f"share:    unknown ({sh.get('error') or sh.get('note') or 'no figures'})")
    else:
        out += [
            f"share:    {_size(sh['share_bytes'])} ({sh['source']}) = {share_parts(sh)}",
            f"          context {_context(sh['ctx'])} ({sh['cache_key'] or '-'}), "
            f"{sh['parallel']} at once; KV at CTX x PARALLEL {_size(sh.get('kv_total_bytes'))}; "
            f"baseline {sh['baseline_source']}",
        ]
        if sh.get("note"):
            out.append(f"          {sh['note']}")
        if sh.get("kv_note"):
            out.append(f"          {sh['kv_note']}")
    if res.get("now_bytes") is None:
        out.append("resident: not running")
    else:
        peak = _size(res["peak_bytes"]) if res.get("peak_bytes") is not None else "unknown"
        out.append(f"resident: {_size(res['now_bytes'])} now, peak {peak} ({res['source']})")
        if res.get("note"):
            out.append(f"          {res['note']}")
    return out


@click.command(name="ls")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def ls(as_json):
    """Profiles with their service state, pid, port, uptime and memory (now, peak, share)."""
    rows = service_views.rows()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    elif not rows:
        click.echo("no profiles (create one with: macserve new MODEL)")
    else:
        _table(rows)
        counted = sum(r.get("share_bytes") or 0 for r in rows if r.get("resident_bytes"))
        click.echo(machine_line(service_views.machine(), counted))
        for r in rows:  # what KV=auto will do in each share, one line a profile
            if (r.get("share") or {}).get("kv_note"):
                click.echo(f"{r['name']}: {r['share']['kv_note']}")
            if (r.get("share") or {}).get("dtype"):  # the engine on MLX's CPU (sizing/host.py)
                click.echo(f"{r['name']}: its share counts the engine in {r['share']['dtype']}")
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

    The wired limit and RAM, free memory now, each profile's share (weights + KV at CTX x
    PARALLEL + prompt cache + baseline + reserve, or MEMORY=) beside what a running one holds
    now and at its peak, and the sysctl to raise it."""
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
    click.echo(f"free:     {_size(rep.free_bytes)} on this machine now")
    if rep.profiles:
        head = ["PROFILE", "STATE", "AT LOGIN", "CONTEXT", "CACHE", "WEIGHTS", "KV", "x", "PROMPT"]
        head += ["BASELINE", "RESERVE", "SHARE", "NOW", "PEAK"]
        lines = [head]
        for p in rep.profiles:
            sh = p.get("share") or {}
            lines.append(
                [
                    p["name"],
                    p["state"],
                    "yes" if p["at_login"] else "no",
                    _context(sh.get("ctx")),
                    sh.get("cache_key") or "-",
                    _size(sh.get("weights_bytes")),
                    _size(sh.get("kv_bytes")),
                    str(sh.get("parallel") or "-"),
                    _size(sh.get("prompt_cache_bytes")),
                    _size(sh.get("baseline_bytes")),
                    _size(sh.get("reserve_bytes")),
                    _size(p["share_bytes"]),
                    _size(p["resident_bytes"]),
                    _size(p["peak_bytes"]),
                ]
            )
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        for line in lines:
            click.echo("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
        for p in rep.profiles:
            sh = p.get("share") or {}
            whys = [p["error"], p["note"]]
            if sh.get("share_bytes") is not None:
                whys.append(f"share {sh['source']}; baseline {sh['baseline_source']}")
            if (p.get("resident") or {}).get("note"):
                whys.append(p["resident"]["note"])
            for why in filter(None, whys):
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
