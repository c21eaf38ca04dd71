"""How long `macserve ARGS` takes to answer, each run a fresh interpreter (what a user's shell
starts): wall seconds beside the bare interpreter's, measured in the same run so the ratio
holds on a busy machine."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    args: tuple[str, ...]
    seconds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def _wall(argv: list[str]) -> float:
    t = time.perf_counter()
    r = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    took = time.perf_counter() - t
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {r.returncode}: {r.stderr.strip()[-300:]}")
    return took


def time_commands(commands: list[tuple[str, ...]], runs: int) -> tuple[Timing, list[Timing]]:
    """(the bare interpreter, each of `commands` run as `python -m macserve *args`), `runs`
    times each, interleaved round by round so a burst of load falls on all of them alike."""
    base: list[float] = []
    each: list[list[float]] = [[] for _ in commands]
    for _ in range(runs):
        base.append(_wall([sys.executable, "-c", "pass"]))
        for i, args in enumerate(commands):
            each[i].append(_wall([sys.executable, "-m", "macserve", *args]))
    return Timing(("python -c pass",), tuple(base)), [
        Timing(a, tuple(s)) for a, s in zip(commands, each, strict=True)
    ]
