"""`macserve preflight NAME`: the multi-host checks run before a start, per host. Printing only;
the checks are in services/preflight.py."""

from __future__ import annotations

import click

from ..errors import MacserveError
from .fmt import gb as _gb
from .lazy import lazy

health = lazy("macserve.services.health")
pf = lazy("macserve.services.preflight")
providers = lazy("macserve.services.providers")


@click.command()
@click.argument("name")
def preflight(name):
    """Check a multi-host profile's hosts: ssh, Python/mlx/mlx-lm versions, model, memory."""
    profile = health.store().load(name)
    if not profile.multi_host:
        raise MacserveError(f"profile {name} has no HOSTS: nothing to check")
    result = pf.run(profile, providers.for_profile(profile).macserve_on_hosts(profile))
    for c in result.hosts:
        share = ""
        if c.need_bytes is not None:
            a, z = c.layers
            share = f"share {_gb(c.need_bytes)} (layers {a}-{z - 1})"
            if c.budget_bytes is not None:
                share += f" of a {_gb(c.budget_bytes)} budget"
        if c.local:
            what = "local (mlx.launch runs it on this host): not checked" + (
                f"; {share}" if share else ""
            )
        elif c.ok:
            f = c.facts
            what = (
                f"ok: Python {f['python']}, mlx {f['mlx']}, mlx-lm {f['mlx_lm']}"
                + (", model present" if f.get("model") else "")
                + (f", {share}" if share else "")
            )
        else:
            what = "error: " + "; ".join(c.problems)
        click.echo(f"rank {c.rank}  {c.host:<15} {what}")
    for n in result.notes:
        click.echo(f"note: {n}")
    if not result.ok:
        bad = sum(not c.ok for c in result.hosts)
        raise MacserveError(f"pre-flight failed on {bad} host(s)")
