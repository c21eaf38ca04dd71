"""`macserve run NAME`: exec the profile's server in the foreground. This is what services run.

It replaces itself with the server (os.execvpe, no shell, no wrapper process), so the
supervisor's pid is the server's pid, signals reach it directly and its exit code is the
service's exit code.
"""

from __future__ import annotations

import os
import shlex
import sys

from .. import env
from . import providers
from .profiles import ProfileStore
from .supervisors import logs


def exec_profile(name: str) -> None:
    profile = ProfileStore().load(name)
    provider = providers.for_profile(profile)
    argv = provider.argv(profile)
    variables = dict(os.environ)
    variables.update(provider.env(profile))
    # launchd appends to its log files forever; rotate at each (re)start (set in the plist only).
    for p in env.rotate_logs():
        logs.rotate(p)
    # First line of every start in the service log: what exactly was started.
    print(f"macserve run {name}: {shlex.join(argv)}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execvpe(argv[0], argv, variables)
