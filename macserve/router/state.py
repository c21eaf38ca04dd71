"""A profile's lifecycle in the router, as a state machine: the named states, the moves allowed
between them, and the one `transition` that makes a move (refusing any the table does not
have, logging every one it makes: profile, from, to, why).

It is the router's view, kept beside the supervisor's (`Model.seen`: the supervisor's state as
last read). The pool moves a model itself when it starts or stops it, and follows the
supervisor when it reads a change it did not make: a crash (running -> stopped), a
`macserve start` or `stop` by hand, supervisord respawning a server (running -> starting).
"""

from __future__ import annotations

import enum
import logging

log = logging.getLogger("macserve.router")


class State(enum.Enum):
    STOPPED = "stopped"  # no process, as far as the router knows
    STARTING = "starting"  # admitted and being started (or a `set` restarting it); or the
    # supervisor starting it
    RUNNING = "running"  # its server answered, or the supervisor runs it
    STOPPING = "stopping"  # a stop under way (the router's, or one seen)
    FAILED = "failed"  # its last start failed and it was stopped again: the next request
    # starts it afresh; its error is listed beside it

    @property
    def shown(self) -> str:
        """What `/v1/models`, `ls` and `/metrics` say: the four states the API has always
        listed; a failed start is stopped (its `error` says why)."""
        return "stopped" if self is State.FAILED else self.value


_S = State
# from -> the states it may move to. What is not here is a bug in the router, refused.
MOVES: dict[State, frozenset[State]] = {
    # a start; seen running or stopping (a start or stop by hand, a router restarted)
    _S.STOPPED: frozenset({_S.STARTING, _S.RUNNING, _S.STOPPING}),
    # ready; the start failed; refused room in the budget (or seen gone); a stop meanwhile
    _S.STARTING: frozenset({_S.RUNNING, _S.FAILED, _S.STOPPED, _S.STOPPING}),
    # a stop; seen stopped (a crash, a stop by hand); a restart (not ready, respawned, `set`)
    _S.RUNNING: frozenset({_S.STOPPING, _S.STOPPED, _S.STARTING}),
    # stopped; seen coming back (a stop by hand that was a restart)
    _S.STOPPING: frozenset({_S.STOPPED, _S.STARTING, _S.RUNNING}),
    # the next request starts it; a stop from the page; seen running (started by hand)
    _S.FAILED: frozenset({_S.STARTING, _S.STOPPING, _S.RUNNING}),
}


class IllegalTransition(RuntimeError):
    """A move the table does not allow: a bug in the router, never a user's error."""


class Machine:
    """One profile's state. `transition` is the only way it changes."""

    def __init__(self, name: str, state: State = State.STOPPED):
        self.name = name
        self._state = state

    @property
    def state(self) -> State:
        return self._state

    def transition(self, to: State, why: str) -> None:
        """Move to `to`, logged with why; IllegalTransition if the table has no such move
        (staying put is not a move either: the caller checks first)."""
        was = self._state
        if to not in MOVES[was]:
            raise IllegalTransition(f"{self.name}: {was.value} -> {to.value} refused ({why})")
        self._state = to
        log.info("%s: %s -> %s: %s", self.name, was.value, to.value, why)
