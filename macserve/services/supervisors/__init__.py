"""Supervised services: one `Backend` interface (base.py), two implementations.

  launchd     macOS (launchd.py): a LaunchAgent plist driven by launchctl.
  supervisor  elsewhere (supervisord.py): supervisord from PyPI `supervisor`.

The backend is picked by platform; MACSERVE_SERVICE_BACKEND=launchd|supervisor overrides it.
"""

from __future__ import annotations

import sys

from ... import env
from ...errors import MacserveError
from .base import Backend, ServiceSpec, Status, log_dir, log_path, package_root, spec_for
from .launchd import LaunchdBackend
from .supervisord import SupervisorBackend

__all__ = [
    "Backend",
    "ServiceSpec",
    "Status",
    "backend_name",
    "get_backend",
    "log_dir",
    "log_path",
    "package_root",
    "spec_for",
]


def backend_name() -> str:
    name = env.service_backend() or ("launchd" if sys.platform == "darwin" else "supervisor")
    if name not in ("launchd", "supervisor"):
        raise MacserveError(f"MACSERVE_SERVICE_BACKEND={name}: expected launchd or supervisor")
    return name


def get_backend() -> Backend:
    return LaunchdBackend() if backend_name() == "launchd" else SupervisorBackend()
