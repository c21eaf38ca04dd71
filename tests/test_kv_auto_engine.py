"""KV=auto on the demo model in process (issue 45's done-when): a share that holds the batch
at CTX in bf16 gets a window covering the context, run as one that never ends (no code row,
ever; served end to end by tests/test_kv_auto_serve.py), a window given (`serve --kv-window`)
is the one run; a share too small for that gets a shorter window, its caches hold codes in the calibration's
formats, and MLX's allocator stays within the share's part for them while they fill.

The share is cut as `serve --memory` cuts it (capacity.fit_share, the figures measured on the
loaded model); the baseline is 0 here, so the share is MLX's own part of it. The sequences
are filled as the server fills them: a prefill in chunks, then a decode step."""

import mlx.core as mx
import numpy as np
import pytest

from macserve.cache_kinds import ALL_ROWS, window_bytes
from macserve.engine import scratch
from macserve.engine.caches import CacheSpec, cache_bytes, clone, formats, latent_caches
from macserve.server.capacity import (
    RESERVE,
    fit_share,
    fitted,
    weights_bytes,
    window_figures,
)
from macserve.server.disk_cache import DiskTier
from macserve.server.disk_identity import identity
from macserve.services import providers

from .conftest import TINY_MODEL

pytestmark = pytest.mark.model

CTX = 1024  # past int2's own sink + window (576 rows): room for a window between
BATCH = 2
# the process before its weights: the engine's own figure until a start measures it
BASELINE = providers.get("macserve").assumed_baseline


@pytest.fixture(scope="module")
def figures(bundle):
    """(spec, its figures at CTX: int2's window, one more bf16 row, all bf16), measured."""
    spec = CacheSpec.for_model(TINY_MODEL, "auto")
    return spec, window_figures(bundle, spec, CTX)


@pytest.fixture
def budgeted():
    yield
    scratch.set_budget(None)


def _fill(bundle, spec, n: int = BATCH) -> list:
    """`n` sequences of CTX tokens, as the server fills them: CTX - 1 prefilled in the chunks
    a prefill's scratch budget allows at each position (engine/scratch.py), then a decode
    step."""
    w = scratch.model_widths(bundle.model)
    seqs = []
    for s in range(n):
        caches = bundle.caches(spec)
        toks = (mx.arange(CTX) * (s + 3)) % 2000
        p = 0
        while p < CTX:
            L = 1 if p == CTX - 1 else min(scratch.chunk(w, p, 2048), CTX - 1 - p)
            out = bundle.model(toks[None, p : p + L], cache=caches)
            mx.eval(out[:, -1], [c.state for c in caches])
            del out
            p += L
        seqs.append(caches)
    return seqs


def _codes(seqs) -> int:
    return sum(c.codes_lat.length for caches in seqs for c in latent_caches(caches))


def _share(bundle, kv_room: int) -> int:
    """The share whose room for caches (batch + the prompt cache's sequence) is `kv_room`."""
    return int((BASELINE + weights_bytes(bundle.model) + kv_room) / (1 - RESERVE)) + 1


def test_a_share_that_holds_the_batch_in_bf16_runs_a_window_that_never_ends(bundle, figures):
    spec, (base, row, full) = figures
    share = _share(bundle, (BATCH + 1) * full)
    plan = fit_share(bundle, spec, CTX, share, BASELINE, None, BATCH)
    assert (plan.window, plan.max_batch) == (CTX, BATCH), plan.describe()
    run = fitted(spec, plan.window, CTX)
    # every row bf16 for good: no sequence writes a code, whatever its length (served end to
    # end: tests/test_kv_auto_serve.py counts the code rows)
    assert run.quant.recent == ALL_ROWS and fitted(spec, CTX - 65, CTX).quant.recent < CTX
    # the calibration's formats, layer by layer, as int2 stores them
    int2 = CacheSpec.for_model(TINY_MODEL, "int2")
    assert formats(bundle.caches(run)) == formats(bundle.caches(int2))
    # a window given (serve --kv-window: a profile's share fitted it) is the one run, sized
    # on these figures (plan_share refuses a batch that does not fit at it, as at any)
    given = fit_share(bundle, spec, CTX, share, BASELINE, None, BATCH, window=640)
    assert given.window == 640
    assert given.kv_bytes_per_sequence == window_bytes(CTX, 640, base, row, full)


def test_a_share_too_small_for_bf16_writes_codes_and_holds_within_it(bundle, figures, budgeted):
    spec, (base, _, full) = figures
    share = _share(bundle, (BATCH + 1) * (base + full) // 2)  # half way: int2 .. all bf16
    plan = fit_share(bundle, spec, CTX, share, BASELINE, None, BATCH)
    assert plan.window is not None and plan.window + 64 < CTX, plan.describe()
    assert BATCH * full > plan.kv_bytes  # all bf16, the batch would not fit its part
    scratch.set_budget(plan.scratch_bytes)  # as serve --memory sets it (capacity.hold_to)
    run = fitted(spec, plan.window, CTX)
    mx.synchronize()
    before = mx.get_active_memory()  # the weights and whatever else this process holds
    mx.reset_peak_memory()
    # every sequence of the batch alike, filled one after another: one shows each's part
    seqs = _fill(bundle, run, 1)
    peak = mx.get_peak_memory() - before
    held = sum(cache_bytes(c) for caches in seqs for c in caches)
    print(plan.describe(), f"; held {held:,} B, peak {peak:,} B over the weights")
    assert _codes(seqs) > 0
    assert held <= plan.kv_bytes_per_sequence  # a sequence within its part of the share
    # MLX's peak within the share less the process, its weights and the batch's other
    # sequences: this one, the prompt cache's part (unused here) and the reserve (the
    # prefill's scratch)
    others = (BATCH - 1) * plan.kv_bytes_per_sequence
    assert peak <= plan.share_bytes - plan.baseline_bytes - plan.weights_bytes - others
    # a prompt cache stored at one window is not another window's (disk_identity.py)
    assert identity(bundle, run)["cache"] != identity(bundle, fitted(spec, CTX, CTX))["cache"]


def _prefill(bundle, spec, toks: list[int], chunk: int = 256) -> list:
    caches = bundle.caches(spec)
    for p in range(0, len(toks), chunk):
        bundle.model(mx.array(toks[p : p + chunk])[None], cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def _flat(state) -> list:
    out = []
    for x in state:
        if isinstance(x, tuple | list):
            out += _flat(x)
        else:
            out.append(x)
    return out


def _same(a, b) -> bool:
    fa, fb = _flat(a.state), _flat(b.state)
    return len(fa) == len(fb) and all(
        mx.array_equal(x, y).item() if isinstance(x, mx.array) else x == y for x, y in zip(fa, fb)
    )


def test_an_all_bf16_prefix_is_stored_as_its_rows_and_restored_exactly(bundle, tmp_path):
    # the window a share that holds every row bf16 gives (capacity.fitted): one that never ends
    spec = fitted(CacheSpec.for_model(TINY_MODEL, "auto"), CTX, CTX)
    assert spec.quant.recent >= CTX
    toks = ((mx.arange(700) * 7) % 2000).tolist()
    caches = _prefill(bundle, spec, toks)
    n = 128
    tier = DiskTier(tmp_path, 2**30, identity(bundle, spec), lambda: bundle.caches(spec), None, n)
    parts, meta = tier.stored_form(toks, caches, None, 0, -1)
    tier.put(np.asarray(toks), parts, meta, None)
    assert tier.flush()
    # what the sequence held: bf16 rows in the blocks, no code made of them
    files = [mx.load(str(p)) for p in tier.dir.glob("*.safetensors")]
    names = {k for f in files for k in f}
    assert not any(".s.cl." in k or ".s.cp." in k for k in names), sorted(names)
    assert any(".s.rl." in k for k in names)
    # the whole entry: its state byte for byte
    plan = tier.best(np.asarray(toks + [5]), False, 0)
    got = tier.load(plan, False, 0)
    assert got.keep == 700 and all(_same(a, b) for a, b in zip(got.caches, caches))
    # another prompt sharing 5 blocks: entered at their end, nothing prefilled again, and
    # exactly the state a sequence of those tokens holds (the same rows)
    other = toks[:640] + [1, 2, 3]
    plan = tier.best(np.asarray(other), False, 0)
    assert plan is not None and plan.tail is None and plan.keep == 640, plan
    got = tier.load(plan, False, 0)
    held = [clone(c) for c in caches]
    assert all(c.trim(60) == 60 for c in held)  # the sequence's own rows at 640 tokens
    assert all(_same(a, b) for a, b in zip(got.caches, held))
    tier.close()
