"""KV=auto end to end (issue 45's done-when): `macserve serve` started from a profile as a
service starts it (`macserve run NAME`, services/worst_case.py), on the demo model.

- A profile whose share holds its batch at CTX in bf16 (no MEMORY: the share is what CTX x
  PARALLEL needs in bf16) is served every row bf16: `/health` says the share's window, and
  after PARALLEL sequences near CTX at once `/metrics` counts no code row.
- A profile with a MEMORY half way between int2's share and bf16's is served the window
  its share says (`inspect` / `ls`'s line: the profile passes it, `serve --kv-window`), its
  sequences write codes, and driven to its worst case (more clients than PARALLEL near CTX,
  then the prompt cache filled, then the clients again) its process tree stays within its
  share by the memory probe of tests/test_memory_real.py.

The first start measures the baseline as a first start on a machine does (services/
baseline.py), so the second profile's share counts the process as measured. Before the
window was passed, the server fitted its own on its process as loaded (about 93 MB on the
demo against the share's 162 MiB once serving) and served the second profile all bf16.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from macserve.services import share, worst_case
from macserve.services.profiles import Profile
from macserve.sizing.kv_layout import auto_figures
from macserve.sizing.report import inspect_source

from .fixtures import TINY_MODEL, free_port

pytestmark = pytest.mark.e2e

CTX, PARALLEL = 1024, 2  # past int2's own sink + window (576 rows): room for a window between
TOLERANCE = 0.10  # test_memory_real's: the baseline's noise between two starts, RSS's sharing
# more clients than PARALLEL (they must queue), prompts past the tight window's 768 bf16 rows;
# the prompt cache's bound (one sequence) is passed by the batch's entries and one prompt more
LOAD = worst_case.Load(clients=3, prompt_tokens=850, answer_tokens=8, cache_prompts=1)


def _profile(name: str, **keys: str) -> Profile:
    values = {
        "PROVIDER": "macserve",
        "MODEL": str(TINY_MODEL),
        "PORT": str(free_port()),
        "CTX": str(CTX),
        "PARALLEL": str(PARALLEL),
        "KV": "auto",
    }
    return Profile(name, {**values, **keys})


def _served(url: str) -> dict:
    """The window the server runs, the code rows its finished sequences held and the
    formats its layers store codes in."""
    health = httpx.get(url + "/health", timeout=10).json()
    text = httpx.get(url + "/metrics", timeout=10).text
    rows = re.search(r"^macserve_kv_code_rows_total (\S+)$", text, re.M)
    assert rows, text[:2000]
    formats = {layer["format"] for layer in health["kv_cache"]["layers"]}
    return {
        "window": health["kv_cache"]["window"],
        "code_rows": float(rows.group(1)),
        "formats": formats,
    }


def test_auto_is_bf16_where_the_share_holds_it_and_codes_within_a_smaller_one(tmp_path: Path):
    held = _profile("auto-held")
    s = share.share_of(held)
    assert s.window == CTX and "every row bf16" in (s.kv_note or ""), s
    res = worst_case.Result(held.name, held.provider, s)
    with worst_case.running(held, tmp_path / "held.log") as pid:
        share.record_baseline(held, pid)  # as a first start here does
        url = worst_case.providers.base_url(held)
        drv = worst_case.Driver(url, res)
        words = max(1, int(LOAD.prompt_tokens * drv.calibrate() / 4.6))
        drv.batch(list(range(1, PARALLEL + 1)), words, LOAD.answer_tokens)
        got = _served(url)
    assert res.answered == PARALLEL + 1 and not res.failed, res.as_dict()
    assert got["window"] == CTX and got["code_rows"] == 0, got

    # half way between int2's share and bf16's, on inspect's figures and the measured baseline
    base, _, full = auto_figures(inspect_source(str(TINY_MODEL)).layouts["macserve/int2"], CTX)
    measured = share.share_of(held)
    assert measured.baseline_source.startswith("measured"), measured
    fixed = measured.weights_bytes + measured.baseline_bytes + share.MIN_RESERVE + share.MIB
    memory = fixed + (PARALLEL + 1) * (base + full) // 2
    tight = _profile("auto-tight", MEMORY=f"{memory}B")
    t = share.share_of(tight)
    assert t.error is None and t.window is not None and t.window + 64 < CTX, t
    seen: dict = {}
    r = worst_case.drive(
        tight, LOAD, tmp_path / "tight.log", before_stop=lambda u: seen.update(_served(u))
    )
    figures = r.as_dict()
    print(figures, seen)
    print(  # docs/memory.md quotes this line
        f"\n{tight.name}: share {t.share_bytes:,} B (baseline {t.baseline_bytes:,} B "
        f"measured), {t.kv_note}; served window {seen['window']}, {seen['code_rows']:,.0f} "
        f"code rows ({', '.join(sorted(seen['formats']))}); peak {r.peak_bytes:,} B = "
        f"{r.ratio:.3f}x its share"
    )
    assert not r.failed and r.answered >= LOAD.cache_prompts + LOAD.clients, figures
    assert seen["window"] == t.window, (seen, t.kv_note)  # the window `ls` says is the one served
    assert seen["code_rows"] > 0, seen
    # in the calibration's formats (its gate's, per layer: /health), the same as all bf16 runs
    assert seen["formats"] == got["formats"] and "bf16" not in seen["formats"], seen
    assert r.peak_bytes <= t.share_bytes * (1 + TOLERANCE), figures
