"""`macserve doctor`: will the services that start at login fit this Mac's GPU memory?

The GPU may wire (lock in RAM for Metal) up to `iogpu.wired_limit_mb` MB; 0 means macOS's
default, about 2/3 of RAM up to 36 GB and 3/4 above (sizing/budget.py). Each profile needs
its weights plus its KV cache at the context it is configured for: inspect's arithmetic
plus the sequences it serves at once, its prompt cache and its own process: its share
(`share.share`). The profiles that start at login (installed and not stopped) must fit
together, or the later ones fail to load (or the system starts swapping wired memory away).

Raising the limit is one root command, `sudo sysctl iogpu.wired_limit_mb=N`; it lasts until
the next reboot. docs/services.md ("GPU wired limit") shows the LaunchDaemon that sets it at
every boot. The suggestion leaves HEADROOM for macOS and everything else.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field

from ..errors import MacserveError
from ..sizing.budget import default_working_set, machine_budget
from . import journal
from .health import store
from .share import share, unknown
from .supervisors import get_backend

HEADROOM = 8 * 2**30  # what the suggested limit leaves to macOS and the other programs
DOCS = "docs/services.md#gpu-wired-limit"


@dataclass
class Report:
    total_memory_bytes: int
    on_mac: bool
    wired_limit_mb: int | None  # the sysctl's value (0: macOS default); None off a Mac
    budget_bytes: int
    budget_source: str
    profiles: list[dict] = field(default_factory=list)
    at_login_bytes: int = 0
    fits: bool = True
    suggested_wired_limit_mb: int = 0
    raise_command: str = ""
    persist: str = DOCS
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def suggested_limit_mb(total: int) -> int:
    """RAM less HEADROOM, but never below macOS's own default."""
    return max(default_working_set(total), total - HEADROOM) // 2**20


def doctor(memory_bytes: int | None = None) -> Report:
    """This Mac (or one with `memory_bytes` of RAM) against every profile's share."""
    b = machine_budget(memory_bytes)
    on_mac = platform.system() == "Darwin" and memory_bytes is None
    wired = None
    if on_mac:
        wired = b.budget_bytes // 2**20 if "sysctl" in b.source else 0
    rep = Report(b.total_bytes, on_mac, wired, b.budget_bytes, b.source)
    backend = get_backend()
    for name in store().names():
        try:
            settled = journal.recover(name, backend)
        except MacserveError as e:
            settled = f"{journal.pending_note(name)} ({e})"
        if settled:
            rep.notes.append(settled)
        st = backend.status(name)
        # Installed and not stopped: launchd loads it at login (RunAtLoad); `stop` disables it.
        at_login = st.installed and st.state not in ("stopped", "not installed")
        try:
            fp = share(name)
        except MacserveError as e:
            # One broken profile is its own row, not a refusal of every other one.
            fp = unknown(name, str(e))
        row = {
            "name": name,
            "state": st.state,
            "at_login": at_login,
            **{k: v for k, v in fp.as_dict().items() if k != "name"},
            "cache_bytes": fp.kv_total_bytes,  # the columns `doctor` prints (cli/views.py)
            "total_bytes": fp.share_bytes,
        }
        rep.profiles.append(row)
        if at_login and fp.share_bytes:
            rep.at_login_bytes += fp.share_bytes
    rep.fits = rep.at_login_bytes <= rep.budget_bytes
    rep.suggested_wired_limit_mb = suggested_limit_mb(b.total_bytes)
    rep.raise_command = f"sudo sysctl iogpu.wired_limit_mb={rep.suggested_wired_limit_mb}"
    if backend.name == "supervisor":
        rep.notes.append(
            "supervisord is not started at boot: 'at login' here means the services it starts "
            "with itself (installed and not stopped)"
        )
    if not on_mac:
        rep.notes.append(
            "not a Mac (or --memory given): the budget is the Mac rule applied to "
            f"{b.total_bytes / 2**30:.1f} GB; the sysctl applies on macOS"
        )
    if rep.at_login_bytes > suggested_limit_mb(b.total_bytes) * 2**20:
        rep.notes.append(
            "the services that start at login need more than the suggested limit leaves: stop "
            "one (macserve stop NAME) or give it a smaller context or cache (macserve set NAME -- "
            "CTX=N KV=TYPE)"
        )
    return rep
