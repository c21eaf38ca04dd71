"""Which GGUF files make up one model: the parts of a split GGUF (`-00001-of-00003.gguf`,
only the first holding the metadata), and the model chosen by its quant among a folder's or a
repository's files (`Q4_K_M`, as a whole token of the name). Names only: nothing is read.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import MacserveError

SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


def split_group(name: str, names) -> list[str]:
    """All parts of a split GGUF (`-00001-of-00003.gguf`) among `names`, or just the file."""
    m = SPLIT.search(name)
    if not m:
        return [name]
    stem = name[: m.start()]
    return sorted(
        n
        for n in names
        if SPLIT.search(n)
        and n[: SPLIT.search(n).start()] == stem
        and SPLIT.search(n).group(2) == m.group(2)
    )


def first_part(group: list[str]) -> str:
    """The part of a group holding the metadata (part 00001, or the one unsplit file)."""
    firsts = [g for g in group if not SPLIT.search(g) or SPLIT.search(g).group(1) == "00001"]
    if not firsts:
        raise MacserveError(
            f"{group[0]}: part 00001 of this split GGUF is missing (only it holds the metadata)"
        )
    return firsts[0]


def _quant_re(quant: str):
    # Q4_K must not match Q4_K_M, nor Q4_0 IQ4_0: the quant is a whole token of the name.
    return re.compile(
        rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9]|_[A-Za-z0-9])", re.IGNORECASE
    )


def gguf_files(where: str, ggufs: list[str], quant: str | None) -> tuple[str, list[str]]:
    """(the file holding the header, every part) of the GGUF model `quant` among `ggufs` (the
    projector files of vision models left out); `where` names the folder or repo in errors."""
    model_files = [f for f in ggufs if "mmproj" not in f.lower()]
    if quant:
        rx = _quant_re(quant)
        model_files = [f for f in model_files if rx.search(f)]
        if not model_files:
            raise MacserveError(f"{where}: no GGUF file for quant {quant!r}")
    groups = {}
    for f in model_files:
        m = SPLIT.search(f)
        groups.setdefault(f[: m.start()] if m else f, []).append(f)
    if len(groups) > 1:
        names = ", ".join(sorted(Path(k).name.removesuffix(".gguf") for k in groups)[:8])
        raise MacserveError(
            f"{where}: {len(groups)} GGUF models match; pick one with "
            f"--quant or REPO:QUANT ({names})"
        )
    (group,) = groups.values()
    return first_part(sorted(group)), sorted(group)
