"""Creating a profile: `new` (a model, sized by inspect), `new_worker` (a llama.cpp RPC
worker), `new_router` (the router as a service). Each writes the profile only once its port,
secrets and flags have passed, then installs and starts it; a start that fails stops the service
and keeps the profile for `set` to fix.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from pathlib import Path

from .. import env
from ..errors import MacserveError
from ..sizing.report import report
from . import plan as sizing_plan
from . import providers, run, share
from .health import (
    TAIL_LINES,
    Interrupts,
    Outcome,
    SetFailed,
    base_url,
    spec,
    store,
    wait_ready,
    with_log_line,
)
from .ports import DEFAULT_PORT, check_port, pick_port, ports_used
from .profiles import Profile, ProfileStore, check_name
from .providers.llama_rpc import DEFAULT_PORT as RPC_DEFAULT_PORT
from .providers.router import DEFAULT_PORT as ROUTER_DEFAULT_PORT
from .supervisors import get_backend, log_path, logs


def default_name(source: str, quant: str | None) -> str:
    base = Path(source.rstrip("/")).name if "/" in source or source.endswith(".gguf") else source
    base = re.sub(r"\.gguf$", "", base, flags=re.I)
    if ":" in base:
        base, quant = base.split(":", 1)[0], quant or base.split(":", 1)[1]
    name = re.sub(r"[^a-z0-9._-]+", "-", (base + (f"-{quant}" if quant else "")).lower()).strip(
        "-."
    )
    return check_name(name[:64] or "model")


def new(
    source: str,
    quant=None,
    name=None,
    provider=None,
    ctx="auto",
    port=None,
    host="127.0.0.1",
    extra_args: str = "",
    start=True,
    timeout=300.0,
    tick=None,
    api_key: str | None = None,
    pull=None,
    kv: str | None = None,
) -> Outcome:
    """`pull(source, quant) -> local path`, when given, downloads a hub model first (with
    progress) so the service starts from the local copy instead of downloading in its wait.
    `kv`: the cache type (the provider's own name; None: its default), sized and written as KV."""
    name = check_name(name) if name else default_name(source, quant)
    st = store()
    if st.exists(name):
        raise MacserveError(
            f"profile {name} exists (change it with macserve set {name}, or pick --name)"
        )
    notes = []
    folder = Path(source).expanduser()
    shipped = providers.get(provider).shipped_kv(folder) if kv is None and provider else None
    if shipped:
        kv = shipped[0]
        notes.append(shipped[1])
    plan = sizing_plan.plan(source, quant, provider, ctx, kv=kv)
    prov = providers.get(plan.provider)
    if ctx not in (None, "auto"):
        refuse_ctx(
            "--ctx", plan.n_ctx, plan.model_max, plan.fits, plan.budget_bytes, plan.cache_key
        )
    notes += plan.notes
    args: list[str] = []
    typed = {"KV": plan.kv}
    cache = plan.cache_key or f"{plan.kv} (not modelled by inspect)"
    if plan.n_ctx and (prov.context_args(plan.n_ctx) or ctx not in (None, "auto")):
        typed["CTX"] = str(plan.n_ctx)
        why = (
            "from --ctx"
            if ctx not in (None, "auto")
            else (
                "the model's own limit, which fits the budget"
                if plan.n_ctx == plan.model_max
                else f"the most that fits the {plan.budget_bytes / 2**30:.1f} GB budget"
            )
        )
        notes.append(f"context {plan.n_ctx:,} tokens ({why}; {cache} cache)")
        if prov.context_args(plan.n_ctx) is None:
            notes.append(
                f"{plan.provider} has no context-size flag: macserve refuses a longer prompt "
                "(400) in the process it runs the server in"
            )
    elif plan.n_ctx:
        notes.append(
            f"{plan.provider} has no context-size flag: macserve refuses a prompt past the "
            f"model's limit (400); {plan.fits:,} tokens fit the budget with {plan.cache_key}"
            if plan.fits
            else f"{plan.provider} has no context-size flag"
        )
    if plan.mtp_layers:
        draft = prov.draft_args(plan.mtp_layers)
        args += draft
        notes.append(
            f"MTP drafting on ({shlex.join(draft)})"
            if draft
            else f"model has {plan.mtp_layers} MTP layer(s); {plan.provider} here cannot draft with them"
        )
    try:
        args += shlex.split(extra_args or "")
    except ValueError as e:
        raise MacserveError(f"--extra-args does not parse: {e}") from None
    model = plan.model
    if pull is not None and plan.remote:
        model = str(pull(source, quant))  # sized first: a model that cannot fit is not downloaded
        notes.append(f"serving the downloaded copy in the Hugging Face cache: {model}")
    values = {
        "PROVIDER": plan.provider,
        "MODEL": model,
        "HOST": host,
        "PORT": None,
        **{k: v for k, v in typed.items() if v},
        "EXTRA_ARGS": shlex.join(args),
    }
    secrets = {}
    if api_key:
        secrets["API_KEY"] = api_key
    if token := env.hf_token():
        secrets["HF_TOKEN"] = token
        notes.append(f"HF_TOKEN from this shell kept for the service in {st.secrets_path(name)}")
    comment = f"# macserve new {shlex.quote(source)}" + (f" --quant {quant}" if quant else "")
    return _create(st, name, values, comment, port, start, timeout, tick, notes, secrets)


def new_worker(
    name: str,
    host: str,
    port: int | None = None,
    extra_args: str = "",
    start=True,
    timeout: float = 60.0,
    tick=None,
) -> Outcome:
    """A supervised llama.cpp RPC worker (rpc-server) for another Mac's llama-server."""
    name = check_name(name)
    st = store()
    if st.exists(name):
        raise MacserveError(
            f"profile {name} exists (change it with macserve set {name}, or pick --name)"
        )
    try:
        args = shlex.split(extra_args or "")
    except ValueError as e:
        raise MacserveError(f"--extra-args does not parse: {e}") from None
    values = {
        "PROVIDER": "llama.cpp-rpc",
        "HOST": host,
        "PORT": None,
        "EXTRA_ARGS": shlex.join(args),
    }
    out = _create(
        st,
        name,
        values,
        f"# macserve worker {name} --host {host}",
        port or RPC_DEFAULT_PORT,
        start,
        timeout,
        tick,
        [],
        {},
    )
    out.url = f"{host}:{store().load(name).port}"
    return out


def new_router(
    name: str = "router",
    host: str = "127.0.0.1",
    port: int | None = None,
    args: list[str] | tuple[str, ...] = (),
    api_key: str | None = None,
    start=True,
    timeout: float = 60.0,
    tick=None,
) -> Outcome:
    """`macserve router` as a supervised service: a profile with PROVIDER=router whose
    EXTRA_ARGS are the router's options (--ttl, --memory, ...)."""
    name = check_name(name)
    st = store()
    if st.exists(name):
        raise MacserveError(
            f"profile {name} exists (change it with macserve set {name}, or pick --name)"
        )
    values = {"PROVIDER": "router", "HOST": host, "PORT": None, "EXTRA_ARGS": shlex.join(args)}
    secrets = {"API_KEY": api_key} if api_key else {}
    comment = f"# macserve router --install --name {name}"
    return _create(
        st, name, values, comment, port, start, timeout, tick, [], secrets, ROUTER_DEFAULT_PORT
    )


def refuse_ctx(
    what: str,
    n: int | None,
    model_max: int | None,
    fits: int | None,
    budget_bytes: int,
    cache_key: str | None,
    multi_host: bool = False,
) -> None:
    """Refuse a context beyond the model's limit or beyond what fits the memory budget (as
    inspect counts it), naming the limit and the largest context that fits."""
    if not n:
        return
    over_limit = model_max is not None and 0 < model_max < n
    fits = None if multi_host else fits  # split over several Macs: each holds a part
    over_budget = fits is not None and n > fits
    if not (over_limit or over_budget):
        return
    budget = f"{budget_bytes / 2**30:.1f} GB budget"
    if fits == 0:
        raise MacserveError(
            f"{what} {n:,}: the weights alone do not fit the {budget} (nothing written)"
        )
    largest = min(x for x in (model_max, fits) if x)
    why = (
        f"beyond the model's limit of {model_max:,} tokens"
        if over_limit
        else f"the {cache_key} cache at {n:,} tokens does not fit the {budget}"
    )
    raise MacserveError(
        f"{what} {n:,}: {why}; the largest context that fits is {largest:,}"
        + (f" with {cache_key}" if cache_key and fits is not None else "")
        + " (nothing written)"
    )


def check_ctx(profile: Profile, what: str = "CTX") -> None:
    """`refuse_ctx` for a profile's typed CTX, sized by inspect for its MODEL and KV; a model
    inspect cannot read here is left to its server."""
    prov = providers.for_profile(profile)
    if profile.ctx is None or not prov.serves_model or not profile.model:
        return
    key = prov.cache_key(profile)
    try:
        r = report(profile.model)
    except MacserveError:
        return
    fits = r["max_context"].get(key) if key else None
    refuse_ctx(
        what,
        profile.ctx,
        r.get("model_max_context"),
        fits,
        r["budget_bytes"],
        key,
        profile.multi_host,
    )


def moved_note(st: ProfileStore, name: str, prov, moved: Mapping[str, str]) -> str:
    how = ", ".join(
        f"{k} as {prov.api_key_env if k == 'API_KEY' else 'HF_TOKEN'}" for k in sorted(moved)
    )
    return (
        f"moved {', '.join(sorted(moved))} out of EXTRA_ARGS into {st.secrets_path(name)} "
        f"(mode 0600); the server gets {how} in its environment, never on its command line"
    )


def _create(
    st: ProfileStore,
    name: str,
    values: dict,
    comment: str,
    port: int | None,
    start: bool,
    timeout: float,
    tick,
    notes: list[str],
    secrets: dict[str, str],
    first_port: int = DEFAULT_PORT,
) -> Outcome:
    """Write a new profile (port picked or checked, flags checked), then install and start it."""
    host = values["HOST"]
    with st.lock():
        if st.exists(name):
            raise MacserveError(f"profile {name} exists")
        used = ports_used(st)
        if port is None:
            port = pick_port(host, set(used), first_port)
        else:
            check_port(host, port, used, start)
        profile = Profile(name, {**values, "PORT": str(port)}, (comment,))
        prov = providers.for_profile(profile)
        profile, lifted = prov.lift(profile)  # --extra-args '-c N': the CTX key
        if lifted:
            check_ctx(profile)  # the CTX (or KV) that came from --extra-args
            notes.append(lifted)
        profile, moved = prov.move_secrets(profile)
        if moved:
            notes.append(moved_note(st, name, prov, moved))
        secrets = {**secrets, **moved}
        prov.check_secrets(secrets)
        # a profile that cannot start is never written; a MEMORY too small for the model is
        # refused with the figures
        prov.check_args(profile, share.check(profile).limits())
        st.save_secrets(name, secrets)  # first: the profile never exists without its key
        st.save(profile)
    out = Outcome(name, base_url(profile), notes)
    if not start:
        return out
    backend = get_backend()
    offset = logs.size(log_path(name))
    run.reset_backoff(name)
    with Interrupts() as sig:
        try:
            backend.apply(spec(profile))
            ok, why = wait_ready(
                profile, timeout, tick=tick or (lambda e, s: None), backend=backend
            )
        except KeyboardInterrupt:
            ok, why = False, "interrupted"
        if not ok:
            with sig.hold():
                tail = logs.tail(log_path(name), TAIL_LINES, since=offset)
                why = with_log_line(profile, why, tail)
                backend.stop(name)  # do not leave a crash loop behind
    if not ok:
        raise SetFailed(
            f"{name} did not become healthy: {why}; service stopped, profile kept "
            f"(fix with macserve set {name} ..., then macserve start {name})",
            tail,
            False,
        )
    out.pid = backend.status(name).pid
    return out
