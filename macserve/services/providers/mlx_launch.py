"""`python -m macserve.providers.mlx_launch MLX_LAUNCH [ARGS...]`: MLX's `mlx.launch`, run in
this process, as a service's server process.

Three things about mlx.launch make it a poor supervised process as is, and this fixes them
without changing what it runs:
- When a rank dies (even by SIGKILL) it stops the other ranks and then exits 0, which a
  supervisor reads as a clean stop and does not restart. A server never ends on its own, so
  here any return from mlx.launch is exit 1: the supervisor restarts the whole group.
- A planned stop (SIGTERM, SIGINT, SIGHUP) would end it at once, and with it the pipes that
  carry the ranks' output. Here it keeps running: the signal is passed on to the process
  group (supervisord signals the group already; launchd signals this process only), rank 0
  drains (mlx_drain.py), the other ranks follow rank 0's generations and end when it ends;
  once mlx.launch returns, the exit is 0, a clean stop. Bounded by the ranks' own limits
  (rank 0: DRAIN and its cut; the others: DRAIN + mlx_drain.FOLLOW_SECS) and the
  supervisor's SIGKILL at DRAIN + values.STOP_MARGIN.
- Its main loop polls stdin to forward it to the ranks; a service's stdin is /dev/null, always
  readable, so that loop spins a core. Here stdin is a pipe nobody writes to. (Its per-rank
  threads still spin: they select() on the rank's always-writable stdin. Upstream's, not fixed
  here; about one core on the head host while the service runs.)
"""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import sys

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class _Stop:
    requested = False

    @classmethod
    def on_signal(cls, sig, _frame) -> None:
        if cls.requested:
            return  # ours, passed on to the group below, or a second one: nothing more to do
        cls.requested = True
        print(
            f"macserve: stop ({signal.Signals(sig).name}): rank 0 drains, the other ranks "
            "end with it",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.suppress(OSError):  # a repeat under supervisord; else the ranks' news
            os.killpg(0, sig)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m macserve.providers.mlx_launch MLX_LAUNCH [ARGS...]")
    r, _w = os.pipe()  # _w stays open for the life of the process: stdin never reaches EOF
    os.dup2(r, 0)
    for sig in STOP_SIGNALS:
        signal.signal(sig, _Stop.on_signal)
    sys.argv = sys.argv[1:]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0) and not _Stop.requested:
            raise
    if _Stop.requested:
        print("macserve: stop: every rank has ended; exiting 0", file=sys.stderr, flush=True)
        sys.exit(0)
    print(
        "macserve: mlx.launch ended (a rank exited); exiting 1 so the group is restarted",
        file=sys.stderr,
        flush=True,
    )
    sys.exit(1)


if __name__ == "__main__":
    main()
