"""The disk tier's N-token prefix blocks, in process on the demo model: a chain of blocks read
back by another PromptCache (a restart) decodes greedily as a cold prefill does (bf16, INT2,
a drafting request's MTP rows); two prompts that share a prefix share its block files; a
corrupt middle block ends the chain there with one log line; the size bound holds."""

import logging
import resource
import signal

import mlx.core as mx
import pytest

from macserve.engine.caches import CacheSpec, clone
from macserve.engine.mtp_decode import MTPDecoder
from macserve.int2_format import INT2
from macserve.server.disk_cache import DiskTier
from macserve.server.disk_identity import identity
from macserve.server.prompt_cache import PromptCache

from .conftest import TINY_MODEL
from .fixtures import prompt_ids

pytestmark = pytest.mark.model

N = 64  # small blocks, so a demo-sized prompt makes a chain of several
# The INT2 cache's blocks hold codes for every token past the sink; a chain of them alone is
# entered `recent` tokens before its end (its window rebuilt from codes, those tokens
# prefilled again), so the prompts below run to 760-900 tokens (the demo's context is 1,024).
W = INT2.recent


def _tier(bundle, spec, root, mtp=False, max_bytes=2**30):
    return DiskTier(
        root,
        max_bytes,
        identity(bundle, spec),
        lambda: bundle.caches(spec),
        bundle.mtp_cache_factory(spec) if mtp else None,
        block_tokens=N,
    )


def _greedy(b, caches, ids, n=24) -> list[int]:
    """n greedy tokens after feeding `ids` into `caches`."""
    out = []
    x = mx.array([ids])
    for _ in range(n):
        t = int(mx.argmax(b.model(x, cache=caches)[0, -1]).item())
        out.append(t)
        x = mx.array([[t]])
    return out


def _files(tier, prefix):
    return sorted(tier.dir.glob(f"{prefix}-*.safetensors"))


SYSTEM = "You are a careful assistant. Answer in verse, and cite the play and the act. "


@pytest.mark.parametrize("kind", ["bf16", "int2"])
def test_a_chain_of_blocks_decodes_as_a_cold_prefill(bundle, kind, tmp_path):
    spec = CacheSpec.for_model(TINY_MODEL, kind)
    first = prompt_ids(bundle, "HAMLET.\nTo be, or not to be, that is the question. ", 900)
    follow = first + prompt_ids(bundle, "OPHELIA.\nGood my lord, how does your honour? ", 40)
    pc = PromptCache(2**30, _tier(bundle, spec, tmp_path))
    cs = bundle.caches(spec)
    bundle.model(mx.array([first]), cache=cs)
    pc.insert(first, [clone(c) for c in cs])
    assert pc.disk.flush()
    st = pc.disk.stats()
    # Whole blocks of the rows no later token changes: all 900 tokens' for bf16, and for
    # INT2 the sink and codes of every token past it (the window's rows too, as codes).
    assert st["blocks"] == 900 // N
    assert len(_files(pc.disk, "b")) == st["blocks"] and len(_files(pc.disk, "t")) == 1
    again = PromptCache(2**30, _tier(bundle, spec, tmp_path))  # a new process
    hit = again.fetch(follow)
    assert hit is not None and hit.cached == len(first)
    assert again.stats()["tiers"]["disk"]["cached_tokens"] == len(first)
    warm = _greedy(bundle, hit.caches, follow[hit.cached :])
    assert warm == _greedy(bundle, bundle.caches(spec), follow)


def test_a_drafting_chain_keeps_its_mtp_rows(bundle, tmp_path):
    spec = CacheSpec.for_model(TINY_MODEL, "int2")
    dec = MTPDecoder(bundle.model, bundle.mtp(), k=1, mtp_cache=bundle.mtp_cache_factory(spec))
    first = prompt_ids(bundle, "VIOLA.\nWhat country, friends, is this? ", 880)
    follow = first + prompt_ids(bundle, "CAPTAIN.\nThis is Illyria, lady. ", 40)
    pc = PromptCache(2**30, _tier(bundle, spec, tmp_path, mtp=True))
    caches, mcache = bundle.caches(spec), dec.mtp_cache()
    dec.prefill(first, caches, mcache)
    pc.insert(first, [clone(c) for c in caches], clone(mcache))
    assert pc.disk.flush() and pc.disk.stats()["blocks"] >= 5
    hit = PromptCache(2**30, _tier(bundle, spec, tmp_path, mtp=True)).fetch(follow, mtp=True)
    assert hit is not None and hit.cached == len(first) - 1

    warm = list(dec.generate(follow, 24, caches=hit.caches, mtp_cache=hit.mtp, cached=hit.cached))
    cold = list(dec.generate(follow, 24, caches=bundle.caches(spec)))
    assert warm == cold and len(warm) == 24


@pytest.mark.parametrize("kind", ["bf16", "int2"])
def test_prompts_that_share_a_prefix_share_its_blocks(bundle, kind, tmp_path):
    spec = CacheSpec.for_model(TINY_MODEL, kind)
    system = prompt_ids(bundle, SYSTEM, 800)
    a = system + prompt_ids(bundle, "Who is Yorick? ", 60)
    b = system + prompt_ids(bundle, "Where is Elsinore? ", 70)
    pc = PromptCache(2**30, _tier(bundle, spec, tmp_path))
    for ids in (a, b):
        cs = bundle.caches(spec)
        bundle.model(mx.array([ids]), cache=cs)
        pc.insert(ids, cs)
    assert pc.disk.flush()
    # Each one's whole blocks (INT2: its sink and codes, every token past the sink), those
    # within the system prompt once: 13 + 13 - 12 = 14 files.
    na, nb = len(a) // N, len(b) // N
    shared = min(na, nb, len(system) // N)
    assert len(_files(pc.disk, "b")) == na + nb - shared == 14
    # A third chat with the same system prompt, after a restart: bf16, a's entry rolled
    # back; INT2 from the shared whole blocks, `recent` tokens before their end (its window
    # rebuilt from codes, those tokens prefilled again: disk_blocks.py).
    c = system + prompt_ids(bundle, "What is a bare bodkin? ", 50)
    hit = PromptCache(2**30, _tier(bundle, spec, tmp_path)).fetch(c)
    short = 0 if kind == "bf16" else W
    assert hit.cached == (len(system) if kind == "bf16" else (len(system) // N) * N - short)
    # With the tails gone (the size bound takes them before their blocks), the shared whole
    # blocks alone serve it.
    for f in _files(pc.disk, "t"):
        f.unlink()
    again = PromptCache(2**30, _tier(bundle, spec, tmp_path))
    hit = again.fetch(c)
    assert hit is not None and hit.cached == (len(system) // N) * N - short
    warm = _greedy(bundle, hit.caches, c[hit.cached :])
    assert warm == _greedy(bundle, bundle.caches(spec), c)


@pytest.mark.parametrize("kind", ["bf16", "int2"])
def test_a_corrupt_middle_block_ends_the_chain_with_one_line(bundle, kind, tmp_path, caplog):
    spec = CacheSpec.for_model(TINY_MODEL, kind)
    ids = prompt_ids(bundle, "ROMEO.\nBut soft, what light through yonder window breaks? ", 880)
    more = ids + prompt_ids(bundle, "JULIET.\nO Romeo, Romeo! ", 30)
    pc = PromptCache(2**30, _tier(bundle, spec, tmp_path))
    cs = bundle.caches(spec)
    bundle.model(mx.array([ids]), cache=cs)
    pc.insert(ids, cs)
    assert pc.disk.flush()
    chain = pc.disk.entries[next(iter(pc.disk.entries))].chain
    assert len(chain) >= 5
    bad = pc.disk.dir / f"b-{chain[3]}.safetensors"
    data = bytearray(bad.read_bytes())
    data[-10] ^= 0xFF
    bad.write_bytes(bytes(data))
    caplog.clear()
    with caplog.at_level(logging.WARNING, "macserve.server"):
        again = PromptCache(2**30, _tier(bundle, spec, tmp_path))
        hit = again.fetch(more)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "checksum" in lines[0] and chain[3] in lines[0], lines
    assert not bad.exists() and again.disk.stats()["entries"] == 0
    if kind == "bf16":  # blocks 0..2 still serve: rows alone
        assert hit is not None and hit.cached == 3 * N
        assert _greedy(bundle, hit.caches, more[hit.cached :]) == _greedy(
            bundle, bundle.caches(spec), more
        )
    else:  # blocks 0..2 are fewer tokens than the INT2 window prefilled again: nothing
        assert 3 * N <= W and hit is None


def test_the_size_bound_holds_over_blocks_and_tails(bundle, tmp_path):
    spec = CacheSpec.for_model(TINY_MODEL, "int2")
    one = PromptCache(2**30, _tier(bundle, spec, tmp_path / "measure"))
    cs = bundle.caches(spec)
    ids = prompt_ids(bundle, "MACBETH.\nTomorrow, and tomorrow, and tomorrow. ", 760)
    bundle.model(mx.array([ids]), cache=cs)
    one.insert(ids, cs)
    one.disk.flush()
    per_entry = one.disk.stats()["bytes"]
    bound = int(per_entry * 2.5)
    pc = PromptCache(2**30, _tier(bundle, spec, tmp_path / "bounded", max_bytes=bound))
    for i, play in enumerate(
        ["LEAR.\nNothing will come of nothing. ", "PUCK.\nLord, what fools! "] * 3
    ):
        ids = prompt_ids(bundle, f"{i} {play}", 760)
        cs = bundle.caches(spec)
        bundle.model(mx.array([ids]), cache=cs)
        pc.insert(ids, cs)
        assert pc.disk.flush()
        on_disk = sum(f.stat().st_size for f in pc.disk.dir.glob("*.safetensors"))
        assert on_disk == pc.disk.stats()["bytes"] <= bound
    st = pc.disk.stats()
    assert st["entries"] == 2 and st["writes"] == 6
    assert all(e.chain for e in pc.disk.entries.values())  # INT2 codes: blocks, not tails alone
    # What is left is whole: every entry's blocks are there.
    assert all(k in pc.disk.blocks for e in pc.disk.entries.values() for k in e.chain)


def test_a_full_disk_is_one_line_and_the_answer_stays_right(bundle, tmp_path, caplog):
    """A write that meets a full disk (here the file size limit, RLIMIT_FSIZE: the same
    EFBIG a full filesystem's ENOSPC takes) leaves no temp file and no entry, one log line;
    the memory tier still serves, and after a restart the whole blocks written before the
    failed tail serve as a chain of blocks does (the rest is prefilled)."""
    spec = CacheSpec.for_model(TINY_MODEL, "int2")
    ids = prompt_ids(bundle, "PROSPERO.\nWe are such stuff as dreams are made on. ", 800)
    more = ids + prompt_ids(bundle, "MIRANDA.\nO brave new world! ", 30)
    pc = PromptCache(2**30, _tier(bundle, spec, tmp_path))
    cs = bundle.caches(spec)
    bundle.model(mx.array([ids]), cache=cs)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    was = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a killed process
    caplog.clear()
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, hard))  # a tail is larger
        with caplog.at_level(logging.WARNING, "macserve.server"):
            pc.insert(ids, [clone(c) for c in cs])
            assert pc.disk.flush()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, was)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "full" in lines[0], lines
    assert not [f for f in pc.disk.dir.iterdir() if f.name.startswith(".")]
    on_disk = sum(f.stat().st_size for f in pc.disk.dir.glob("*.safetensors"))
    assert pc.disk.stats()["entries"] == 0 and on_disk == pc.disk.stats()["bytes"]
    hit = pc.fetch(more)  # memory
    assert hit.cached == len(ids)
    cold = _greedy(bundle, bundle.caches(spec), more)
    assert _greedy(bundle, hit.caches, more[hit.cached :]) == cold
    caplog.clear()
    with caplog.at_level(logging.WARNING, "macserve.server"):
        hit = PromptCache(2**30, _tier(bundle, spec, tmp_path)).fetch(more)
    assert not caplog.records
    assert hit is not None and hit.cached == (len(ids) // N) * N - W
