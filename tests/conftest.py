"""Shared fixtures: every test runs with its own MACSERVE_HOME, never the real home."""

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONFIGS = Path(__file__).resolve().parent / "configs"  # real published configs, see its README
TINY_MODEL = REPO / "macserve" / "models" / "tiny-mla"


@pytest.fixture(autouse=True)
def macserve_home(tmp_path, monkeypatch):
    home = tmp_path / "macserve-home"
    home.mkdir()
    monkeypatch.setenv("MACSERVE_HOME", str(home))
    return home


def llama_server_binary():
    """The llama-server the tests use: MACSERVE_LLAMA_SERVER, else PATH; None when absent."""
    p = os.environ.get("MACSERVE_LLAMA_SERVER")
    if p and os.access(p, os.X_OK):
        return p
    return shutil.which("llama-server")


@pytest.fixture
def llama_server():
    p = llama_server_binary()
    if p is None:
        if os.environ.get("CI"):
            pytest.fail("CI must provide llama-server (scripts/build-llama-server.sh)")
        pytest.skip("no llama-server binary (set MACSERVE_LLAMA_SERVER)")
    return p
