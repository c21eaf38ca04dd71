"""What a profile needs in memory, as `inspect` counts it: the weights plus its cache at the
profile's context and cache type. doctor and the router's budget read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MacserveError
from ..sizing.report import inspect_source
from . import providers
from .health import store
from .profiles import Profile


@dataclass(frozen=True)
class Footprint:
    """A profile's memory as inspect counts it: weights + its cache at its configured context."""

    name: str
    weights_bytes: int | None = None
    cache_bytes: int | None = None
    ctx: int | None = None
    cache_key: str | None = None
    note: str = ""
    error: str | None = None

    def as_dict(self) -> dict:
        """What the router lists for a model (`GET /v1/models`, `macserve router ls`)."""
        return {
            "weights_bytes": self.weights_bytes,
            "cache_bytes": self.cache_bytes,
            "ctx": self.ctx,
            "cache_key": self.cache_key,
            "note": self.note or None,
            "error": self.error,
        }

    @property
    def total_bytes(self) -> int | None:
        if self.weights_bytes is None and self.cache_bytes is None:
            return None
        return (self.weights_bytes or 0) + (self.cache_bytes or 0)


def footprint(name: str) -> Footprint:
    return footprint_of(store().load(name))


def footprint_of(profile: Profile) -> Footprint:
    """A profile's footprint, saved or not (the web page sizes a change before making it)."""
    p = providers.typed(profile)
    name = p.name
    prov = providers.for_profile(p)
    if not prov.serves_model:
        return Footprint(name, note=prov.footprint_note)
    key = prov.cache_key(p)
    try:
        rep = inspect_source(p.model)
    except MacserveError as e:
        return Footprint(name, cache_key=key, error=str(e))
    ctx, note = p.ctx, ""
    if ctx is None:
        ctx = rep.shape.max_position_embeddings
        note = "no context set: counted at the model's limit"
        if prov.context_args(1) is None:
            note = f"{prov.label} grows its cache per request: counted up to the model's limit"
    elif prov.context_args(1) is None:
        note = f"{prov.label} grows its cache per request: counted up to CTX"
    if key is None:
        note = (note + "; " if note else "") + f"inspect does not model a {p.kv} cache"
    lay = rep.layouts.get(key) if key else None
    cache = lay.bytes_at(ctx) if lay is not None and lay.supported and ctx else None
    if p.multi_host:
        note = (note + "; " if note else "") + "the whole model, before it is split over HOSTS"
    return Footprint(name, rep.weights_bytes, cache, ctx, key, note)
