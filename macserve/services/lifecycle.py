"""A profile's service, installed and running or not: start, restart, stop, remove; and where
a client reaches a profile (`endpoint`). A start is refused in one line when the server would
refuse the profile, before the unit changes.
"""

from __future__ import annotations

from ..errors import MacserveError
from . import journal, providers, run, share
from .health import TAIL_LINES, Outcome, SetFailed, base_url, spec, store, wait_ready, with_log_line
from .ports import check_host
from .profiles import Profile
from .supervisors import get_backend, log_path, logs


def checked(name: str) -> Profile:
    """The profile, refused now if its server would refuse it (secrets, flags, model)."""
    st = store()
    profile = providers.typed(st.load(name))
    prov = providers.for_profile(profile)
    prov.check_secrets(st.load_secrets(name))
    check_host(profile.host)  # a hand-edited HOST the server could not bind
    prov.check_args(profile, share.share_of(profile).limits())
    return profile


def start(name: str, timeout: float = 300.0, wait=True, tick=None) -> Outcome:
    """Install the unit if needed and start it; a unit that changed is reloaded first."""
    backend = get_backend()
    journal.recover(name, backend)  # a killed `set`'s change first: start what is settled
    profile = checked(name)
    before = backend.status(name)
    if before.state == "running" and not backend.install(spec(profile)):
        if providers.for_profile(profile).ready(profile, timeout=5.0):
            return Outcome(name, base_url(profile), ["already running"], before.pid)
        if run.backing_off(name) < 2 * run.BACKOFF_FIRST:
            # still loading: wait for it (a start that never becomes healthy says so)
            offset = logs.size(log_path(name))
            return _finish(profile, backend, timeout, wait, tick, None, offset)
        # else a crash loop between two crashes: restarted below, and waited for
    offset = logs.size(log_path(name))
    run.reset_backoff(name)
    backend.apply(spec(profile))
    return _finish(profile, backend, timeout, wait, tick, before.pid, offset)


def restart(name: str, timeout: float = 300.0, wait=True, tick=None) -> Outcome:
    backend = get_backend()
    journal.recover(name, backend)
    profile = checked(name)
    before = backend.status(name)
    offset = logs.size(log_path(name))
    run.reset_backoff(name)
    backend.apply(spec(profile))
    return _finish(profile, backend, timeout, wait, tick, before.pid, offset)


def _finish(profile, backend, timeout, wait, tick, old_pid, offset) -> Outcome:
    out = Outcome(profile.name, base_url(profile))
    if wait:
        ok, why = wait_ready(
            profile, timeout, old_pid=old_pid, tick=tick or (lambda e, s: None), backend=backend
        )
        if not ok:
            tail = logs.tail(log_path(profile.name), TAIL_LINES, since=offset)
            raise SetFailed(
                f"{profile.name} is not healthy: {with_log_line(profile, why, tail)}", tail, False
            )
    out.pid = backend.status(profile.name).pid
    return out


def stop(name: str) -> None:
    backend = get_backend()
    journal.recover(name, backend)
    store().load(name)
    # not installed and not loaded (a launchd job whose plist is gone is stopped all the same)
    if not backend.installed(name) and backend.status(name).state == "not installed":
        raise MacserveError(f"service {name} is not installed")
    backend.stop(name)


def remove(name: str) -> None:
    st = store()
    if not st.path(name).exists() and not get_backend().installed(name):
        raise MacserveError(f"no profile {name!r}")
    with st.lock(name):
        get_backend().uninstall(name)
        st.delete(name)
        run.reset_backoff(name)


def has_profile(name: str) -> bool:
    try:
        return store().exists(name)
    except MacserveError:  # not even a valid name (a prompt with spaces)
        return False


def endpoint(name: str | None) -> tuple[str, str | None]:
    """(base URL without /v1, the API key the profile's server requires, if any) of profile
    `name`, or of the only profile when `name` is None."""
    st = store()
    if name is None:
        names = st.names()
        if len(names) != 1:
            raise MacserveError(
                "no profiles yet: give a URL, e.g. http://127.0.0.1:8080"
                if not names
                else f"several profiles ({', '.join(names)}): name one, or give a URL"
            )
        name = names[0]
    profile = st.load(name)
    return base_url(profile), st.load_secrets(name).get("API_KEY")
