"""supervisord's control channel (XML-RPC on its unix socket) with deadlines.

supervisor's own transport has none: a supervisord stopped with SIGSTOP still accepts the
connection (the kernel's backlog) and never answers, and every command asking it anything
waited for ever. Here each call has a deadline, and a timeout becomes one MacserveError that
names supervisord and what to do (`hung`, from the backend, which knows its pid).
"""

from __future__ import annotations

import socket
import xmlrpc.client
from collections.abc import Callable
from pathlib import Path

from supervisor.xmlrpc import SupervisorTransport, UnixStreamHTTPConnection

from ...errors import MacserveError

# The control channel's deadlines: a status question answers in milliseconds; a stop waits up
# to the program's stopwaitsecs (its profile's DRAIN + values.STOP_MARGIN) for the process to
# exit, and supervisord's SIGKILL after it. A supervisord stopped (SIGSTOP) or hung answers
# neither: past these, one line naming it, never a command that waits for ever.
RPC_TIMEOUT = 10.0
RPC_STOP_SLACK = 30.0  # beyond the longest stopwaitsecs a stop call may wait out


class _TimedConnection(UnixStreamHTTPConnection):
    deadline = RPC_TIMEOUT

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.deadline)
        self.sock.connect(self.socketfile)


class _TimedTransport(SupervisorTransport):
    def __init__(self, sock: Path, deadline: float):
        super().__init__(None, None, f"unix://{sock}")

        def connection():
            conn = _TimedConnection("localhost")
            conn.socketfile, conn.deadline = str(sock), deadline
            return conn

        self._get_connection = connection


class Rpc:
    """supervisord's XML-RPC namespace, each call bounded by a deadline: a timeout or a broken
    socket is one MacserveError naming supervisord and what to do."""

    def __init__(self, sock: Path, deadline: float, hung: Callable[[float], str]):
        self._hung, self._deadline = hung, deadline
        transport = _TimedTransport(sock, deadline)
        self._proxy = xmlrpc.client.ServerProxy("http://127.0.0.1", transport=transport).supervisor

    def __getattr__(self, method):
        fn = getattr(self._proxy, method)

        def call(*args):
            try:
                return fn(*args)
            except TimeoutError:
                raise MacserveError(self._hung(self._deadline)) from None
            except (ConnectionError, FileNotFoundError) as e:
                raise MacserveError(
                    f"supervisord went away during {method} ({e.strerror or e}): run the "
                    "command again (it starts a new one)"
                ) from None

        return call
