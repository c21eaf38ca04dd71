"""llama.cpp's `llama-server`: GGUF models, OpenAI-compatible HTTP, `/health` 200 when loaded.

The binary is found in MACSERVE_LLAMA_SERVER, then PATH, then the Homebrew prefixes (a
LaunchAgent's PATH is minimal, and `brew install llama.cpp` puts it in /opt/homebrew/bin on
Apple silicon). MODEL is a local .gguf path (`-m`) or a Hugging Face `owner/repo[:QUANT]`
(`--hf-repo`, which llama-server downloads and caches itself).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from ..errors import MacserveError
from ..profiles import Profile
from . import BaseProvider, help_text, local_model_path

HOMEBREW_DIRS = ("/opt/homebrew/bin", "/usr/local/bin")
_HF_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?$")


def find_llama_server() -> str:
    p = os.environ.get("MACSERVE_LLAMA_SERVER")
    if p:
        if os.access(p, os.X_OK):
            return os.path.abspath(p)
        raise MacserveError(f"MACSERVE_LLAMA_SERVER={p} is not an executable file")
    found = shutil.which("llama-server")
    if found:
        return os.path.abspath(found)
    for d in HOMEBREW_DIRS:
        cand = os.path.join(d, "llama-server")
        if os.access(cand, os.X_OK):
            return cand
    raise MacserveError("llama-server not found (brew install llama.cpp, or set MACSERVE_LLAMA_SERVER)")


class LlamaCpp(BaseProvider):
    name = "llama.cpp"
    label = "llama-server"
    health_path = "/health"  # 503 while loading, 200 when ready: a true readiness probe
    reserved = {
        "--host": "HOST", "--port": "PORT",
        "-m": "MODEL", "--model": "MODEL", "-hf": "MODEL", "-hfr": "MODEL", "--hf-repo": "MODEL",
    }

    def command(self) -> list[str]:
        return [find_llama_server()]

    def model_args(self, profile: Profile) -> list[str]:
        local = local_model_path(profile.model)
        if local is not None:
            return ["-m", str(local)]
        if _HF_REPO.match(profile.model):
            return ["--hf-repo", profile.model]
        raise MacserveError(f"MODEL {profile.model!r} is neither a file nor owner/repo[:QUANT]")

    def check_args(self, profile: Profile) -> None:
        local = local_model_path(profile.model)
        if local is not None and not local.is_file():
            raise MacserveError(f"model file {local} not found")
        self.model_args(profile)
        super().check_args(profile)

    def context_args(self, n_ctx: int) -> list[str]:
        return ["-c", str(n_ctx)]

    def draft_args(self, mtp_layers: int) -> list[str]:
        # Only builds whose --help lists draft-mtp can use the model's own MTP heads.
        if mtp_layers <= 0:
            return []
        text = help_text(self.command(), self.binary_path())
        if re.search(r"--spec-type\s+\S*\bdraft-mtp\b", text):
            return ["--spec-type", "draft-mtp"]
        return []


PROVIDER = LlamaCpp()
