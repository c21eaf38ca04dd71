"""An RPC worker for llama.cpp (`PROVIDER=llama.cpp-rpc`): `rpc-server -H HOST -p PORT`, which
exposes this Mac's GPU to another Mac's llama-server (`BACKEND=rpc`, `HOSTS=this:PORT`).

It serves no model (the head sends the weights), so the profile has no MODEL. rpc-server has
no HTTP: ready means its port accepts a TCP connection. The protocol has no authentication,
which is why `macserve worker` asks for the address to bind explicitly.
"""

from __future__ import annotations

from ..profiles import Profile
from .base import BaseProvider, Limits, url_host
from .llama_cpp import RPC_PORT, find_rpc_server, reachable

DEFAULT_PORT = RPC_PORT


class RpcWorker(BaseProvider):
    name = "llama.cpp-rpc"
    label = "rpc-server"
    reserved = {"-H": "HOST", "--host": "HOST", "-p": "PORT", "--port": "PORT"}
    footprint_note = "an RPC worker: the head sends it layers to hold"

    def command(self) -> list[str]:
        return [find_rpc_server()]

    def model_args(self, profile: Profile) -> list[str]:
        return []

    def argv(self, profile: Profile, limits: Limits | None = None) -> list[str]:
        return (
            self.command()
            + ["-H", profile.host, "-p", str(profile.port)]
            + list(profile.extra_args)
        )

    def health_url(self, profile: Profile) -> str:
        return f"tcp://{url_host(profile.host)}:{profile.port}"

    def ready(self, profile: Profile, timeout: float = 2.0) -> bool:
        return reachable(url_host(profile.host).strip("[]"), profile.port, timeout)


PROVIDER = RpcWorker()
