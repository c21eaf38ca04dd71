"""A request body parsed as a JSON object, with a bound on its nesting: a body built to be
deeply nested (10,000 `[`) would otherwise exhaust Python's recursion while it is parsed, or in
whatever walks it later, and end as a 500 with a traceback instead of the client's 400."""

from __future__ import annotations

import json

from .errors import HttpError

MAX_DEPTH = 64  # far above any real request's schema, far below the recursion limit


def parse_object(raw: bytes, max_depth: int = MAX_DEPTH) -> dict:
    """The body as a dict, or HttpError 400 saying what is wrong with it."""
    deep = HttpError(400, f"request body is nested more than {max_depth} levels deep")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise deep from None
    except (ValueError, UnicodeDecodeError) as e:
        raise HttpError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise HttpError(400, "the body is not a JSON object")
    if depth(body, max_depth) > max_depth:
        raise deep
    return body


def depth(v, stop: int = MAX_DEPTH) -> int:
    """Nesting depth, without recursion; stops counting past `stop`."""
    deepest, todo = 0, [(v, 1)]
    while todo:
        x, d = todo.pop()
        if isinstance(x, dict):
            x = list(x.values())
        if isinstance(x, list):
            deepest = max(deepest, d)
            if d > stop:
                return d
            todo.extend((y, d + 1) for y in x)
    return deepest
