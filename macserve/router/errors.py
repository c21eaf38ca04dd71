"""The errors the router answers itself."""

from __future__ import annotations

from ..web.errors import HttpError


class RouteError(HttpError):
    """A request the router answers itself (web.errors.HttpError, with the router's argument
    order). The router always says whether a client should retry (`x-should-retry`): by
    default not, since its errors are the request's or a server's that failed to start."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "server_error",
        retry: bool = False,
        retry_after: float | None = None,
        code: str | None = None,
    ):
        super().__init__(
            status, message, type_=type_, code=code, retry_after=retry_after, retry=retry
        )
