"""The transcripts in README.md and docs/: run their commands, compare, rewrite.

A transcript is a fenced block whose lines starting with `$ ` are commands and whose other
lines are what those commands printed. Each one carries a marker on the line before its fence
saying what it is:

    <!-- transcript: check -->          run by the tests: cheap and deterministic (no servers)
    <!-- transcript: run -->            rewritten by `macserve dev transcripts --write`, not
                                        run by the tests (servers, minutes, fixed ports)
    <!-- transcript: skip REASON -->    not regenerated: commands only, or a Mac, or a
                                        timing that is the point of the block

A block with a `$ ` line and no marker is an error: every transcript says which it is, so a
new one cannot slip past the check. The commands of one block run in order in one bash, from
the repository's root, in a fresh MACSERVE_HOME (a block is one session; blocks share
nothing). A command's output is compared with the docs' after `normalize`, which masks what
changes between runs and machines (timings, pids, uptimes, this machine's memory budget),
never a size or a count. The repository's own path is written as ~/macserve, and the block's
MACSERVE_HOME as the default one (~/.config/macserve).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..fileio import atomic_write

KINDS = ("check", "run", "skip")
MARKER = re.compile(r"^<!--\s*transcript:\s*(\w+)(.*?)-->\s*$")
FENCE = re.compile(r"^(```+|~~~+)")
SEP = "@@macserve-transcript-command@@"
CHECKOUT = "~/macserve"  # how a transcript writes the repository's path
STOP = (
    "python3 -c 'import os, pathlib; from macserve.services.supervisors.supervisord import "
    'SupervisorBackend; SupervisorBackend(pathlib.Path(os.environ["MACSERVE_HOME"])).shutdown()\''
    " >/dev/null 2>&1 || true"
)


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the fence that opens the block
    kind: str | None  # check | run | skip | None (unmarked)
    reason: str
    lines: list[str]  # the block's body, without fences
    commands: list[tuple[str, list[str]]] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _split(lines: list[str]) -> list[tuple[str, list[str]]]:
    """[(command, its output lines)]. A command whose quotes are still open continues on
    the next lines (a multi-line argument)."""
    out: list[tuple[str, list[str]]] = []
    i = 0
    while i < len(lines):
        ln = lines[i]
        if not ln.startswith("$ "):
            if out:
                out[-1][1].append(ln)
            i += 1
            continue
        cmd = ln[2:]
        while _open_quote(cmd) and i + 1 < len(lines):
            i += 1
            cmd += "\n" + lines[i]
        out.append((cmd, []))
        i += 1
    return out


def _open_quote(s: str) -> bool:
    """True while a double or single quote opened in `s` is not closed (bash's rules, enough
    for the docs: no escaped quotes inside single quotes)."""
    q = None
    esc = False
    for ch in s:
        if esc:
            esc = False
        elif ch == "\\" and q != "'":
            esc = True
        elif q is None and ch in "\"'":
            q = ch
        elif ch == q:
            q = None
        elif q is None and ch == "#":
            break  # a comment: quotes in it do not count
    return q is not None


def blocks(path: Path) -> list[Block]:
    """Every fenced block of `path` that holds a `$ ` line, with its marker."""
    text = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(text):
        m = FENCE.match(text[i])
        if not m:
            i += 1
            continue
        fence = m.group(1)
        j = i + 1
        while j < len(text) and not text[j].startswith(fence):
            j += 1
        body = text[i + 1 : j]
        if any(ln.startswith("$ ") for ln in body):
            prev = text[i - 1] if i else ""
            mk = MARKER.match(prev)
            kind, reason = (mk.group(1), mk.group(2).strip()) if mk else (None, "")
            found.append(Block(path, i + 1, kind, reason, body, _split(body)))
        i = j + 1
    return found


def problems(paths: list[Path]) -> list[str]:
    """What is wrong with the markers: unmarked transcripts, unknown kinds, a skip without
    its reason."""
    out = []
    for p in paths:
        for b in blocks(p):
            if b.kind is None:
                out.append(f"{b.where}: a transcript without a marker ({', '.join(KINDS)})")
            elif b.kind not in KINDS:
                out.append(f"{b.where}: unknown transcript kind {b.kind!r}")
            elif b.kind == "skip" and not b.reason:
                out.append(f"{b.where}: a skipped transcript says why")
    return out


# Masks: what legitimately changes between two runs or two machines. Each masks a figure
# only where its label says it is a time, a pid, a port handed out, or this machine's RAM.
MASKS = [
    (re.compile(r"\d[\d.,]*\s?(?:ms|s|tok/s)\b"), "<time>"),
    (re.compile(r"\b\d+m\d+s\b"), "<uptime>"),
    (re.compile(r"\(pid \d+\)"), "(pid <pid>)"),
    (
        re.compile(r"budget:? +[\d.]+ [GMT]B (\(|for the GPU \()this machine's"),
        "budget <ram> (this machine's",
    ),
    (re.compile(r"free on this machine now [\d.]+ [GMT]B of [\d.]+ [GMT]B"), "free <ram>"),
]


def normalize(lines: list[str]) -> list[str]:
    out = []
    for ln in lines:
        for rx, sub in MASKS:
            ln = rx.sub(sub, ln)
        out.append(ln.rstrip())
    while out and not out[-1]:
        out.pop()
    return out


def run(block: Block, root: Path, timeout: float = 900) -> list[tuple[str, list[str]]]:
    """Run a block's commands in one bash from `root`, in a fresh MACSERVE_HOME; each
    command's output (stdout and stderr, as a terminal shows them)."""
    script = ["exec 2>&1"]
    for cmd, _ in block.commands:
        script += [f"echo {SEP}", cmd]
    # What a block started goes with it: its services, under this home's supervisord (off
    # macOS; a transcript that installs launchd services is a `skip`).
    script += [f"echo {SEP}", STOP]
    with tempfile.TemporaryDirectory(prefix="macserve-transcript-") as home:
        env = dict(os.environ, MACSERVE_HOME=home, COLUMNS="200", NO_COLOR="1")
        env.pop("FORCE_COLOR", None)
        r = subprocess.run(
            ["bash", "-c", "\n".join(script)],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    # The checkout's own path reads as a user's clone would (~/macserve), wherever it runs.
    out = r.stdout.replace(str(root.resolve()), CHECKOUT).replace(home, "~/.config/macserve")
    parts = out.split(SEP + "\n")[1:-1]
    got = [p.splitlines() for p in parts]
    got += [[] for _ in range(len(block.commands) - len(got))]
    return [(cmd, out) for (cmd, _), out in zip(block.commands, got)]


def diff(block: Block, got: list[tuple[str, list[str]]]) -> list[str]:
    """The commands whose output no longer matches the docs (after normalizing), each with
    its first differing line."""
    out = []
    for (cmd, want), (_, have) in zip(block.commands, got):
        a, b = normalize(want), normalize(have)
        if a == b:
            continue
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        x = a[k] if k < len(a) else "(end)"
        y = b[k] if k < len(b) else "(end)"
        first = cmd.splitlines()[0]
        out.append(f"{block.where}: `$ {first}` line {k + 1}:\n  docs: {x}\n  now:  {y}")
    return out


def rewrite(block: Block, got: list[tuple[str, list[str]]]) -> None:
    """Put `got` in place of the block's body in its file (atomically)."""
    text = block.path.read_text().splitlines(keepends=False)
    body: list[str] = []
    for cmd, out in got:
        body.append("$ " + cmd)
        body += [ln.rstrip() for ln in out]
        while body and not body[-1]:
            body.pop()
    start = block.line  # 0-based index of the first body line
    new = text[:start] + body + text[start + len(block.lines) :]
    atomic_write(block.path, "\n".join(new) + "\n")


def doc_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]
