"""KV=auto (issue 45): the rotated latent cache with its rows bf16 as far as the memory share
holds the admitted batch at CTX, and the gate's formats past that.

Pure: the window arithmetic (cache_kinds.auto_window, capacity.auto_batch) and a profile's
share (services/share.py) on inspect's own figures for the demo model. The window a real
server fits, and what its caches then hold, is tests/test_kv_auto_engine.py's."""

import pytest

from macserve.cache_kinds import (
    ALL_ROWS,
    WINDOW_ALIGN,
    CacheKind,
    auto_window,
    describe_window,
    window_bytes,
)
from macserve.int2_format import INT2
from macserve.server.capacity import MAX_AUTO_BATCH, auto_batch
from macserve.services import providers, share
from macserve.services.profiles import Profile
from macserve.sizing import budget
from macserve.sizing.kv_layout import auto_figures
from macserve.sizing.report import inspect_source

from .conftest import TINY_MODEL

CTX = 4096
BASE, ROW = 1_000_000, 1_000  # one sequence at int2's window; one more bf16 row
FULL = BASE + ROW * (CTX - INT2.sink - INT2.recent)  # every row bf16


def test_the_window_is_the_longest_the_sequences_fit():
    # room for every sequence all bf16: the window covers the context, no code
    assert auto_window(CTX, 3, 3 * FULL, BASE, ROW, FULL) == CTX
    # a byte short of that: the longest window in whole blocks that fits, and it fits
    w = auto_window(CTX, 3, 3 * FULL - 1, BASE, ROW, FULL)
    assert INT2.recent <= w < CTX - INT2.sink and w % WINDOW_ALIGN == 0
    assert 3 * window_bytes(CTX, w, BASE, ROW, FULL) <= 3 * FULL - 1
    # half way between the int2 cache and all bf16: a window half way, never over the room
    room = 2 * (BASE + FULL) // 2
    w = auto_window(CTX, 2, room, BASE, ROW, FULL)
    assert 2 * window_bytes(CTX, w, BASE, ROW, FULL) <= room
    assert 2 * window_bytes(CTX, w + WINDOW_ALIGN, BASE, ROW, FULL) > room
    # exactly the int2 cache: its own window; less: None (the share's check refuses it)
    assert auto_window(CTX, 4, 4 * BASE, BASE, ROW, FULL) == INT2.recent
    assert auto_window(CTX, 4, 4 * BASE - 1, BASE, ROW, FULL) is None
    # a context the int2 window already covers: all bf16 or nothing
    assert auto_window(300, 1, FULL, BASE, ROW, FULL) == 300
    with pytest.raises(ValueError):
        auto_window(CTX, 0, FULL, BASE, ROW, FULL)


def test_what_auto_says_it_will_do():
    assert describe_window(CTX, CTX) == "every row bf16 (no code written)"
    line = describe_window(CTX, 1024, "INT2")
    assert line == "bf16 up to 1,088 tokens, then older rows INT2, the first 64 kept bf16"
    assert CacheKind.parse("auto") is CacheKind.AUTO and CacheKind.AUTO.calibrated
    assert CacheKind.AUTO.facts.quant.recent == ALL_ROWS  # unsized: every row bf16


def test_the_batch_and_window_a_server_runs():
    figures = (BASE, ROW, FULL)
    # --max-batch 3 and the default prompt cache (one more sequence): 4 all-bf16 fit
    assert auto_batch(4 * FULL, figures, CTX, None, 3) == (3, CTX)
    n, w = auto_batch(4 * FULL - 1, figures, CTX, None, 3)
    assert n == 3 and w < CTX and 4 * window_bytes(CTX, w, *figures) <= 4 * FULL - 1
    # a prompt cache given in bytes is set aside as such
    assert auto_batch(3 * FULL + 5, figures, CTX, 5, 3) == (3, CTX)
    # no batch given: as many all-bf16 sequences as fit, at most the cap ...
    assert auto_batch(7 * FULL, figures, CTX, None, None) == (6, CTX)
    assert auto_batch(10**6 * FULL, figures, CTX, 0, None) == (MAX_AUTO_BATCH, CTX)
    # ... else one, at the longest window it fits with the prompt cache's sequence
    n, w = auto_batch(2 * BASE + 2 * ROW * 100, figures, CTX, None, None)
    assert n == 1 and INT2.recent < w < CTX
    # not even the int2 cache: its window, for the share's refusal to say so
    assert auto_batch(BASE, figures, CTX, None, 2) == (2, INT2.recent)


def _auto(**keys) -> share.Share:
    values = {"PROVIDER": "macserve", "MODEL": str(TINY_MODEL), "PORT": "9000", "KV": "auto"}
    return share.share_of(Profile("p", {**values, **keys}))


def test_an_auto_share_counts_bf16_and_fits_its_window_in_memory():
    rep = inspect_source(str(TINY_MODEL))
    base, row, full = auto_figures(rep.layouts["macserve/int2"], 1024)
    assert base < full and row > 0
    # without MEMORY: every row bf16, counted as such
    s = _auto(CTX="1024", PARALLEL="2")
    assert (s.kv_bytes, s.window, s.parallel) == (full, 1024, 2)
    assert s.kv_note == "KV=auto at CTX 1,024 x 2: every row bf16 (no code written)"
    assert s.as_dict()["kv_note"] == s.kv_note
    # MEMORY that holds it: the same; a MEMORY between int2's and bf16's: a window between
    held = _auto(CTX="1024", PARALLEL="2", MEMORY=f"{s.share_bytes}B")
    assert held.window == 1024 and held.error is None
    # the demo's shares are small: the reserve is the floor, so the room is known exactly
    fixed = s.weights_bytes + s.baseline_bytes + share.MIN_RESERVE
    mid = fixed + (3 * base + share.MIB + 2 * full + share.prompt_cache_bound(full)) // 2
    assert share.reserve_for(mid) == share.MIN_RESERVE
    tight = _auto(CTX="1024", PARALLEL="2", MEMORY=f"{mid}B")
    assert INT2.recent <= tight.window < 1024 - INT2.sink and tight.error is None
    assert tight.kv_bytes == window_bytes(1024, tight.window, base, row, full) < full
    assert "then older rows INT2 (the calibration's formats)" in tight.kv_note
    assert (
        tight.weights_bytes
        + 2 * tight.kv_bytes
        + tight.prompt_cache_bytes
        + tight.baseline_bytes
        + tight.reserve_bytes
        <= mid
    )
    # PARALLEL derived from MEMORY: the sequences that fit in bf16
    derived = _auto(CTX="1024", MEMORY=f"{s.share_bytes}B")
    assert derived.parallel == 2 and derived.window == 1024
    # too small for even the int2 cache: refused with the figures, as KV=int2 is
    small = _auto(CTX="1024", PARALLEL="2", MEMORY=f"{fixed + 2 * base}B")
    assert small.window == INT2.recent and "too small" in (small.error or "")


def test_without_memory_a_machine_too_small_for_bf16_bounds_the_window(monkeypatch):
    s = _auto(CTX="1024", PARALLEL="64")
    assert s.window == 1024 and s.source == "CTX x PARALLEL"
    # a machine whose budget is a little under that all-bf16 share (a Mac of this size
    # cannot be had here: its budget is the one thing faked)
    small = budget.Budget(s.share_bytes, s.share_bytes - 8 * share.MIB, None, "a small Mac")
    monkeypatch.setattr(share, "machine_budget", lambda: small)
    fitted = _auto(CTX="1024", PARALLEL="64")
    assert fitted.share_bytes == small.budget_bytes and fitted.error is None
    assert INT2.recent <= fitted.window < 1024 - INT2.sink
    assert fitted.kv_bytes < s.kv_bytes and "over this machine's budget" in fitted.note


def test_a_profile_passes_its_window_to_the_server():
    # the server runs the window the share says (serve --kv-window), never one of its own
    s = _auto(CTX="1024", PARALLEL="2")
    rep = inspect_source(str(TINY_MODEL))
    base, _, full = auto_figures(rep.layouts["macserve/int2"], 1024)
    fixed = s.weights_bytes + s.baseline_bytes + share.MIN_RESERVE
    mid = fixed + (3 * base + share.MIB + 2 * full + share.prompt_cache_bound(full)) // 2
    for keys, window in (({}, "1024"), ({"MEMORY": f"{mid}B"}, None)):
        values = {"PROVIDER": "macserve", "MODEL": str(TINY_MODEL), "PORT": "9000", "KV": "auto"}
        p = Profile("p", {**values, "CTX": "1024", "PARALLEL": "2", **keys})
        s = share.share_of(p)
        argv = providers.for_profile(p).argv(p, s.limits())
        assert argv[argv.index("--kv-window") + 1] == (window or str(s.window)) == str(s.window)
    assert s.window < 1024 - INT2.sink  # the second: a window short of the context
    int2 = Profile("q", {**values, "CTX": "1024", "KV": "int2"})
    assert "--kv-window" not in providers.for_profile(int2).argv(
        int2, share.share_of(int2).limits()
    )
