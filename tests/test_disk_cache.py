"""The prompt cache's disk tier in process, on the demo model: an entry written by one
PromptCache is read back by another (a restart) and gives a cold prefill's logits, for the
bf16 and the INT2 cache and a drafting request's MTP rows; a file from another calibration
or a corrupt one, or one of an older format, is skipped with one log line; weights rewritten
in place at the same size are another model (disk_identity.py), their hashes kept by stat."""

import dataclasses
import logging
import os
import shutil
import time

import mlx.core as mx
import numpy as np
import pytest

from macserve.engine.caches import CacheSpec, clone
from macserve.engine.mtp_decode import MTPDecoder
from macserve.server.disk_cache import DiskTier
from macserve.server.disk_identity import RACY, STORE, content_shas, identity
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
        ident or identity(bundle, spec, root),
        lambda: bundle.caches(spec),
        bundle.mtp_cache_factory(spec) if mtp else None,
    )


@pytest.mark.parametrize("kind", ["bf16", "int2"])
def test_an_entry_survives_a_restart_and_gives_a_cold_prefills_logits(bundle, kind, tmp_path):
    spec = CacheSpec.for_model(TINY_MODEL, kind)
    # 700 tokens: past the INT2 cache's bf16 rows (sink 64 + recent 512), so it holds codes
    # (on disk: two 256-token blocks of codes and a tail)
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
    (f,) = pc.disk.dir.glob("t-*.safetensors")  # the tail (its blocks: 512 of 700 tokens)
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


def test_weights_rewritten_in_place_at_the_same_size_are_another_model(bundle, tmp_path):
    # A copy of the demo model's folder, its weights then changed by one byte in place (the
    # name, the size, the folder kept): what a fine-tune written over its checkpoint leaves.
    folder = tmp_path / TINY_MODEL.name
    shutil.copytree(TINY_MODEL, folder)
    b = dataclasses.replace(bundle, path=folder)
    spec = CacheSpec.for_model(folder, "bf16")
    root = tmp_path / "pc"
    ids = prompt_ids(b, "PROSPERO.\nNow does my project gather to a head. ", 300)
    pc = PromptCache(2**30, _tier(b, spec, root))
    cs = b.caches(spec)
    _feed(b, cs, ids)
    pc.insert(ids, cs)
    assert pc.disk.flush() and pc.disk.stats()["writes"] == 1
    # Unchanged weights: a restart restores the prefix.
    hit = PromptCache(2**30, _tier(b, spec, root)).fetch(ids + ids[:5])
    assert hit is not None and hit.cached == len(ids)
    weights = folder / "model.safetensors"
    size, inode = weights.stat().st_size, weights.stat().st_ino
    with open(weights, "r+b") as f:
        f.seek(-1, os.SEEK_END)  # the last tensor's last byte: the header stays as it was
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert weights.stat().st_size == size and weights.stat().st_ino == inode
    again = PromptCache(2**30, _tier(b, spec, root))
    assert again.disk.stats()["entries"] == 0
    assert again.fetch(ids + ids[:5]) is None
    assert again.stats()["tiers"]["disk"]["hits"] == 0


def test_a_weight_files_hash_is_kept_until_its_stat_changes(tmp_path):
    store = tmp_path / STORE
    w = tmp_path / "model.safetensors"
    w.write_bytes(bytes(range(256)) * 64)
    shas, hashed = content_shas([w], store)
    assert hashed == [w.resolve()]
    # Just written: its stat could still be the same after another write in this timestamp
    # tick, so its hash is not kept yet.
    assert content_shas([w], store)[1] == [w.resolve()]
    time.sleep(RACY)
    assert content_shas([w], store)[1] == [w.resolve()]
    assert content_shas([w], store) == (shas, [])  # kept: read from the store, not the file
    st = w.stat()
    # Each change is seen from the stat alone, without reading the file:
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # mtime
    assert content_shas([w], store) == (shas, [w.resolve()])
    with open(w, "ab") as f:  # size
        f.write(b"x")
    changed, hashed = content_shas([w], store)
    assert hashed == [w.resolve()] and changed != shas
    # inode: a file of the same bytes, size and mtime renamed over it
    new = tmp_path / "new"
    new.write_bytes(w.read_bytes())
    os.utime(new, ns=(w.stat().st_atime_ns, w.stat().st_mtime_ns))
    os.replace(new, w)
    assert content_shas([w], store) == (changed, [w.resolve()])
