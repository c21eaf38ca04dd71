"""`macserve run NAME`: exec the profile's server in the foreground. This is what services run.

It replaces itself with the server (os.execvpe, no shell, no wrapper process), so the
supervisor's pid is the server's pid, signals reach it directly and its exit code is the
service's exit code; except for a server with no graceful stop of its own (llama-server,
`provider.drains`): that one runs as this process's child, and this process drains it before
it signals it (graceful.py). (mlx_lm.server has none either; its argv runs it under
providers/mlx_drain.py, which drains it in its own process, so it is exec'd too.) Before that:

- secrets (NAME.secrets, 0600) go into the server's environment, never its argv;
- under a supervisor (MACSERVE_SUPERVISED), a respawn soon after the previous start waits first,
  1 s, then 2, 4, ... up to BACKOFF_MAX: supervisord restarts a server that dies after its
  `startsecs` at once and forever, and launchd only spaces spawns by ThrottleInterval. A start
  that macserve asked for (new, set, start, restart) resets the back-off;
- with MACSERVE_ROTATE_LOGS (launchd, which never rotates), the log is rotated now, and a small
  watcher process copy-truncates it whenever it grows past MACSERVE_LOG_MAX_BYTES while the
  server runs (it exits when the server does).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import time

import psutil

from .. import env
from ..fileio import atomic_write
from . import graceful, providers, share
from .profiles import ProfileStore, check_name
from .supervisors import logs

BACKOFF_FIRST, BACKOFF_MAX = 1.0, 300.0
STABLE_AFTER = 600.0  # a run that lasted this long was healthy: the next start waits nothing


def _state_path(name: str):
    return env.home() / "run" / f"{check_name(name)}.json"


def reset_backoff(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        _state_path(name).unlink()


def backing_off(name: str) -> float:
    """The back-off of the current respawn (0: the last start was not a quick respawn): a
    service in a crash loop shows this even in the moments its supervisor calls it running."""
    try:
        state = json.loads(_state_path(name).read_text())
    except (OSError, ValueError):
        return 0.0
    delay = float(state.get("delay") or 0)
    return delay if time.time() - float(state.get("start") or 0) < STABLE_AFTER else 0.0


def backoff_delay(last_start: float | None, last_delay: float, now: float) -> float:
    """Seconds to wait before this start, given when the previous one happened."""
    if last_start is None or now - last_start >= STABLE_AFTER:
        return 0.0
    return min(BACKOFF_MAX, max(BACKOFF_FIRST, 2 * last_delay))


def _back_off(name: str) -> None:
    path = _state_path(name)
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        state = {}
    now = time.time()
    delay = backoff_delay(state.get("start"), float(state.get("delay") or 0), now)
    atomic_write(path, json.dumps({"start": now + delay, "delay": delay}))
    if delay:
        print(
            f"macserve run {name}: restarted {now - state['start']:.0f}s after the last start; "
            f"back-off {delay:.0f}s",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(delay)


def _watch_log(paths, server: psutil.Process) -> None:
    """Fork a watcher (double fork: reparented, so nobody waits for it and it never becomes
    the server's zombie) that rotates `paths` by size until `server` exits."""
    if os.fork():
        os.wait()
        return
    if os.fork():
        os._exit(0)
    try:
        os.closerange(3, 256)  # keep only stdio (the log itself)
        limit, every = logs.max_bytes(), logs.check_seconds()
        while server.is_running():
            for p in paths:
                logs.rotate(p, limit)
            time.sleep(every)
    finally:
        os._exit(0)


def exec_profile(name: str) -> None:
    st = ProfileStore()
    profile = providers.typed(st.load(name))  # an old profile runs as its typed keys say
    provider = providers.for_profile(profile)
    # the profile's memory share as the server's own limits (share.py; the engine refuses to
    # run without it rather than size itself to the whole machine)
    limits = share.share_of(profile).limits()
    argv = provider.argv(profile, limits)
    variables = dict(os.environ)
    variables.update(provider.env(profile))
    variables.update(provider.limit_env(limits))
    variables.update(provider.secret_env(st.load_secrets(name)))
    if env.supervised():
        _back_off(name)
    rotate = env.rotate_logs()
    for p in rotate:
        logs.rotate(p, logs.max_bytes())
    # First line of every start in the service log: what exactly was started.
    print(f"macserve run {name}: {shlex.join(argv)}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    if rotate:
        _watch_log(rotate, psutil.Process())  # this pid: the server once exec'd, or its parent
    if provider.drains:
        # A server with no graceful stop of its own: this process stays its parent and stops
        # it only once its generations are done (graceful.py).
        os.environ.update(provider.secret_env(st.load_secrets(name)))  # for its HTTP calls
        provider.prepare(profile)
        sys.exit(graceful.run(name, provider, profile, argv, variables))
    os.execvpe(argv[0], argv, variables)
