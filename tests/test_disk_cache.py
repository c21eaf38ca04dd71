"""The prompt cache's disk tier in process, on the demo model: an entry written by one
PromptCache is read back by another (a restart) and gives a cold prefill's logits, for the
bf16 and the INT2 cache and a drafting request's MTP rows; a file from another calibration
or a corrupt one, or one of an older format, is skipped with one log line."""

import logging

import mlx.core as mx
import numpy as np
import pytest

from macserve.engine.caches import CacheSpec, clone
from macserve.engine.mtp_decode import MTPDecoder
from macserve.server.disk_cache import DiskTier, identity
from macserve.server.prompt_cache import PromptCache

from .conftest import TINY_MODEL
from .fixtures import prompt_ids

pytestmark = pytest.mark.model

TOL = dict(rtol=2e-4, atol=2e-4)


def _feed(b, caches, ids) -> np.ndarray:
    out = b.model(mx.array([ids]), cache=caches)
    mx.eval(out, [c.state for c in caches])
    return np.array(out[0, -1])


def _tier(bundle, spec, root, mtp=False, ident=None):
    return DiskTier(
        root,
        2**30,
        ident or identity(bundle, spec),
        lambda: bundle.caches(spec),
        bundle.mtp_cache_factory(spec) if mtp else None,
    )


@pytest.mark.parametrize("kind", ["bf16", "int2"])
def test_an_entry_survives_a_restart_and_gives_a_cold_prefills_logits(bundle, kind, tmp_path):
    spec = CacheSpec.for_model(TINY_MODEL, kind)
    # 700 tokens: past the INT2 cache's bf16 rows (sink 64 + recent 512), so it holds codes
    # (fewer than a 256-token block's: the entry is one file)
    base = prompt_ids(bundle, "HAMLET.\nTo be, or not to be, that is the question. ", 700)
    more = prompt_ids(bundle, "OPHELIA.\nGood my lord, how does your honour? ", 60)
    pc = PromptCache(2**30, _tier(bundle, spec, tmp_path))
    cs = bundle.caches(spec)
    _feed(bundle, cs, base)
    pc.insert(base, [clone(c) for c in cs])
    assert pc.disk.flush() and pc.disk.stats()["writes"] == 1
    again = PromptCache(2**30, _tier(bundle, spec, tmp_path))  # a new process, same folder
    assert again.stats()["entries"] == 0 and again.disk.stats()["entries"] == 1
    hit = again.fetch(base + more)
    assert hit is not None and hit.cached == len(base)
    st = again.stats()
    assert st["tiers"]["disk"]["hits"] == 1 and st["tiers"]["disk"]["cached_tokens"] == len(base)
    assert st["tiers"]["memory"]["hits"] == 0
    warm = _feed(bundle, hit.caches, more)
    cold = _feed(bundle, bundle.caches(spec), base + more)
    np.testing.assert_allclose(warm, cold, **TOL)
    # Now in memory: the next request is a memory hit, not another read.
    assert again.fetch(base + more[:7]).cached == len(base)
    assert again.stats()["tiers"]["memory"]["hits"] == 1


def test_a_drafting_entry_keeps_its_mtp_rows_on_disk(bundle, tmp_path):
    spec = CacheSpec.for_model(TINY_MODEL, "int2")
    dec = MTPDecoder(bundle.model, bundle.mtp(), k=1, mtp_cache=bundle.mtp_cache_factory(spec))
    first = prompt_ids(bundle, "VIOLA.\nWhat country, friends, is this? ", 700)
    follow = first + prompt_ids(bundle, "CAPTAIN.\nThis is Illyria, lady. ", 50)
    pc = PromptCache(2**30, _tier(bundle, spec, tmp_path, mtp=True))
    caches, mcache = bundle.caches(spec), dec.mtp_cache()
    dec.prefill(first, caches, mcache)
    pc.insert(first, [clone(c) for c in caches], clone(mcache))
    pc.disk.flush()
    hit = PromptCache(2**30, _tier(bundle, spec, tmp_path, mtp=True)).fetch(follow, mtp=True)
    assert hit is not None and hit.cached == len(first) - 1

    def draft(caches, mcache, ids):
        h = dec.prefill(ids, caches, mcache)
        t = int(mx.argmax(bundle.model.lm_head(h)[0, -1]).item())
        logits, _ = dec.mtp_forward(h, [t], mcache)
        return np.array(h[0, -1]), np.array(logits[0, -1])

    warm = draft(hit.caches, hit.mtp, follow[hit.cached :])
    cold = draft(bundle.caches(spec), dec.mtp_cache(), follow)
    np.testing.assert_allclose(warm[0], cold[0], **TOL)
    np.testing.assert_allclose(warm[1], cold[1], **TOL)


def test_foreign_and_corrupt_files_are_skipped_with_one_line(bundle, tmp_path, caplog):
    spec = CacheSpec.for_model(TINY_MODEL, "int2")
    ids = prompt_ids(bundle, "ROMEO.\nBut soft, what light through yonder window breaks? ", 700)
    pc = PromptCache(2**30, _tier(bundle, spec, tmp_path))
    cs = bundle.caches(spec)
    _feed(bundle, cs, ids)
    pc.insert(ids, cs)
    pc.disk.flush()
    (f,) = pc.disk.dir.glob("*.safetensors")
    data = f.read_bytes()
    # Another calibration: the same folder named, another identity inside (as a file copied
    # from another server's folder would be).
    other = dict(identity(bundle, spec), calibration="other.safetensors:0123:None")
    with caplog.at_level(logging.WARNING, "macserve.server"):
        t = _tier(bundle, spec, tmp_path, ident=other)
    t.dir.mkdir(parents=True, exist_ok=True)
    (t.dir / f.name).write_bytes(data)
    caplog.clear()
    with caplog.at_level(logging.WARNING, "macserve.server"):
        t = _tier(bundle, spec, tmp_path, ident=other)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "made for calibration" in lines[0], lines
    assert t.stats()["entries"] == 0 and not list(t.dir.glob("*.safetensors"))
    # A flipped byte in the data: found at load (the checksum), one line, then a miss.
    bad = bytearray(data)
    bad[-100] ^= 0xFF
    f.write_bytes(bytes(bad))
    caplog.clear()
    with caplog.at_level(logging.WARNING, "macserve.server"):
        fresh = PromptCache(2**30, _tier(bundle, spec, tmp_path))
        assert fresh.disk.stats()["entries"] == 1
        assert fresh.fetch(ids + ids[:5]) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "checksum" in lines[0], lines
    # Truncated: found by the index, from the header alone.
    f.write_bytes(data[: len(data) // 2])
    caplog.clear()
    with caplog.at_level(logging.WARNING, "macserve.server"):
        t = _tier(bundle, spec, tmp_path)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "truncated" in lines[0] and t.stats()["entries"] == 0, lines
    # A file of the stored form's previous format (2: a per-class layout, before each cache
    # stored its own `state`): skipped from its header, one line, deleted.
    f.write_bytes(data)
    arrays, meta = mx.load(str(f), return_metadata=True)
    mx.save_safetensors(str(f), arrays, dict(meta, format="macserve-prompt-cache/2"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, "macserve.server"):
        t = _tier(bundle, spec, tmp_path)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "format 'macserve-prompt-cache/2', not" in lines[0], lines
    assert t.stats()["entries"] == 0 and not f.exists()
