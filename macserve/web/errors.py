"""The one HTTP error type of every server macserve runs (the engine's `serve` and the router):
what went wrong, as data. How it looks on the wire is the API's business: `openai_api.py` and
`anthropic_api.py` render it, `dialects.py` picks the one a request's path speaks."""

from __future__ import annotations

import math


class HttpError(Exception):
    """A request answered with an error instead of a result (not a MacserveError: it ends one
    request, never a command).

    `param` and `code` are OpenAI's fields (the body field at fault, a machine-readable
    reason); `type_` is OpenAI's error type (Anthropic's is derived from the status). By default
    it follows the status: a 5xx is the server's fault, anything else the request's.
    `retry_after` (seconds) becomes Retry-After. `retry` becomes `x-should-retry`, which the
    OpenAI and Anthropic clients obey over their own rule (they retry 408, 409, 429 and 5xx):
    None sends no header and leaves the choice to them."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        retry: bool | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("server_error" if status >= 500 else "invalid_request_error")
        self.retry_after, self.retry = retry_after, retry

    def headers(self) -> dict[str, str]:
        """The headers every dialect sends with this error."""
        out = {}
        if self.retry is not None:
            out["x-should-retry"] = "true" if self.retry else "false"
        if self.retry_after is not None:
            out["retry-after"] = str(math.ceil(self.retry_after))
        if self.status in (408, 413):
            out["connection"] = "close"  # the rest of the body is not worth reading
        return out
