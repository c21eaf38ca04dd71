"""`python -m macserve.providers.mlx_launch MLX_LAUNCH [ARGS...]`: MLX's `mlx.launch`, run in
this process, as a service's server process.

Two things about mlx.launch make it a poor supervised process as is, and this fixes both
without changing what it runs:
- When a rank dies (even by SIGKILL) it stops the other ranks and then exits 0, which a
  supervisor reads as a clean stop and does not restart. A server never ends on its own, so
  here any return from mlx.launch is exit 1: the supervisor restarts the whole group.
- Its main loop polls stdin to forward it to the ranks; a service's stdin is /dev/null, always
  readable, so that loop spins a core. Here stdin is a pipe nobody writes to. (Its per-rank
  threads still spin: they select() on the rank's always-writable stdin. Upstream's, not fixed
  here; about one core on the head host while the service runs.)
Stopping is unchanged: the supervisor signals the process group (ranks included).
"""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m macserve.providers.mlx_launch MLX_LAUNCH [ARGS...]")
    r, _w = os.pipe()  # _w stays open for the life of the process: stdin never reaches EOF
    os.dup2(r, 0)
    sys.argv = sys.argv[1:]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    print(
        "macserve: mlx.launch ended (a rank exited); exiting 1 so the group is restarted",
        file=sys.stderr,
        flush=True,
    )
    sys.exit(1)


if __name__ == "__main__":
    main()
