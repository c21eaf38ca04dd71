"""The README's first command, `bash scripts/demo.sh`, runs whole: the real model answers,
the demo model is inspected, exported, served by llama-server with MTP and by the engine as a
supervised service, and everything it started is gone at the end.

The one difference from a user's run: scripts/test.sh has just installed what it needs, so
the demo skips `scripts/install.sh` (MACSERVE_DEMO_INSTALLED), and takes its ports and folder
from the test (MACSERVE_DEMO_PORTS, MACSERVE_DEMO_DIR) so it never meets another test's."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import psutil
import pytest

from .fixtures import free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent


def _ours(folder: Path) -> list[str]:
    """Processes still running whose command line names the demo's folder."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
        except psutil.Error:
            continue
        if str(folder) in cmd:
            out.append(f"{p.pid}: {cmd[:120]}")
    return out


def test_demo_runs_whole_and_leaves_nothing_running(tmp_path, llama_server):
    ports = " ".join(str(free_port()) for _ in range(3))
    env = dict(
        os.environ,
        MACSERVE_DEMO_INSTALLED="1",
        MACSERVE_DEMO_DIR=str(tmp_path),
        MACSERVE_DEMO_PORTS=ports,
        MACSERVE_LLAMA_SERVER=llama_server,
    )
    env.pop("MACSERVE_HOME", None)  # the demo makes its own, in its folder
    r = subprocess.run(
        ["bash", "scripts/demo.sh"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "Paris" in r.stdout  # the real model's answer to its question
    assert "MTP draft acceptance:" in r.stdout and "macserve/int2" in out
    assert "tiny-engine: restarted, healthy" in out  # `set CTX=768` restarted the service
    assert "smol: removed" in out and "tiny-engine: removed" in out
    assert _ours(tmp_path) == []
