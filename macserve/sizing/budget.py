"""The machine's side of a plan: how many bytes weights and caches may use on this Mac.

machine_budget(memory_bytes=None) -> Budget   the GPU wired limit, from --memory or this Mac
default_working_set(total)                    macOS's default GPU working set for that RAM
parse_size("256GB") -> bytes                  binary units, as Mac memory is sold
"""

from __future__ import annotations

import math
import platform
import subprocess
from dataclasses import dataclass

import psutil

from .. import env
from ..errors import MacserveError


@dataclass
class Budget:
    total_bytes: int
    budget_bytes: int
    wired_limit_bytes: int | None
    source: str


def _wired_limit_mb() -> int | None:
    try:
        out = subprocess.run(
            ["sysctl", "-n", "iogpu.wired_limit_mb"], capture_output=True, text=True, timeout=2
        )
        return int(out.stdout.strip()) if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def default_working_set(total: int) -> int:
    """The GPU working set macOS allows with iogpu.wired_limit_mb = 0 (the default).

    Assumed: about 2/3 of RAM up to 36 GB and 3/4 above, the split Metal's
    recommendedMaxWorkingSetSize shows on current Macs (a 192 GB Mac reports ~144 GB). An
    assumption, not a measurement here: on a real Mac set iogpu.wired_limit_mb or pass
    --memory to plan for another machine.
    """
    return int(total * (0.75 if total > 36 * 2**30 else 2 / 3))


def machine_budget(memory_bytes: int | None = None) -> Budget:
    """The bytes weights + caches may use: the GPU wired limit, from --memory or this Mac."""
    if memory_bytes is not None:
        ws = default_working_set(memory_bytes)
        return Budget(memory_bytes, ws, ws, "--memory, default GPU working set")
    total = psutil.virtual_memory().total
    if platform.system() == "Darwin" and not env.ignore_wired_limit():
        mb = _wired_limit_mb()
        if mb:
            return Budget(total, mb * 2**20, mb * 2**20, "sysctl iogpu.wired_limit_mb")
        ws = default_working_set(total)
        return Budget(total, ws, ws, "default GPU working set (iogpu.wired_limit_mb=0)")
    # Not a Mac: plan as if this much RAM were a Mac's, so figures compare across machines.
    ws = default_working_set(total)
    return Budget(total, ws, None, "this machine's RAM under the Mac working-set rule")


_UNITS = {
    "TB": 2**40,
    "GB": 2**30,
    "MB": 2**20,
    "KB": 2**10,
    "T": 2**40,
    "G": 2**30,
    "M": 2**20,
    "K": 2**10,
    "B": 1,
}


def parse_size(text: str) -> int:
    """'256GB' -> bytes. Mac memory is sold in binary units: 1 GB here is 2**30 bytes. The unit
    is required (`512` alone would be 512 bytes, never what was meant); `512B` says bytes."""
    s = text.strip().upper().replace("IB", "B").replace(" ", "")
    unit = next((u for u in _UNITS if s.endswith(u)), "")
    num, mult = s[: len(s) - len(unit)], _UNITS.get(unit, 1)
    try:
        v = float(num)
    except ValueError:
        raise MacserveError(f"not a size: {text!r} (try 256GB)") from None
    if v <= 0 or not math.isfinite(v):
        raise MacserveError(f"not a size: {text!r} (try 256GB)")
    if not unit:
        raise MacserveError(f"{text!r} needs a unit: {text.strip()}GB, {text.strip()}MB, ...")
    return int(v * mult)
