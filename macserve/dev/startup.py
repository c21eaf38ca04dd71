"""How long `macserve ARGS` takes to answer, each run a fresh interpreter (what a user's shell
starts): wall seconds beside the bare interpreter's, measured in the same run so the ratio
holds on a busy machine, and the CPU seconds the run used (user + system, which other jobs on
the machine hardly change)."""

from __future__ import annotations

import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    args: tuple[str, ...]
    seconds: tuple[float, ...]  # wall
    cpu: tuple[float, ...]  # user + system

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def cpu_median(self) -> float:
        return statistics.median(self.cpu)


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _run(argv: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one run; the children's CPU counter grows by this one's alone,
    the runs being one after another."""
    cpu, t = _cpu(), time.perf_counter()
    r = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    took = time.perf_counter() - t, _cpu() - cpu
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {r.returncode}: {r.stderr.strip()[-300:]}")
    return took


def time_commands(commands: list[tuple[str, ...]], runs: int) -> tuple[Timing, list[Timing]]:
    """(the bare interpreter, each of `commands` run as `python -m macserve *args`), `runs`
    times each, interleaved round by round so a burst of load falls on all of them alike."""
    base: list[tuple[float, float]] = []
    each: list[list[tuple[float, float]]] = [[] for _ in commands]
    for _ in range(runs):
        base.append(_run([sys.executable, "-c", "pass"]))
        for i, args in enumerate(commands):
            each[i].append(_run([sys.executable, "-m", "macserve", *args]))

    def timing(args, pairs):
        return Timing(args, tuple(w for w, _ in pairs), tuple(c for _, c in pairs))

    return timing(("python -c pass",), base), [
        timing(a, pairs) for a, pairs in zip(commands, each, strict=True)
    ]
