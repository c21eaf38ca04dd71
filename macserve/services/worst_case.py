"""A profile's server driven to its worst realistic case while its process tree's resident
memory is sampled: what `macserve bench memory` prints and tests/test_memory_real.py checks
against the profile's share (services/share.py).

The server is started as a service starts it (`macserve run NAME` on a saved profile: the
provider's argv with the limits its share gives it, and for llama-server the `macserve run`
parent that drains it), in the MACSERVE_HOME of the caller. Then, sampling the tree every
50 ms (sizing/held.py):

1. idle: the tree once it has loaded and settled (the process baseline as this run sees it);
2. batch: `clients` clients at once, each a distinct prompt of about `prompt_tokens` tokens
   (near CTX) and an answer of up to `answer_tokens`: every sequence the server batches at
   its longest. More clients than PARALLEL must queue (or be refused with 429/503), not be
   batched: that is what the share counts;
3. cache: `cache_prompts` more distinct prompts near CTX, one after another, so every
   prompt cache the server keeps (the engine's, mlx_lm.server's, llama-server's
   `--cache-ram`) is filled past its bound;
4. batch again, with the prompt caches full.

Prompts are words drawn from a fixed list by a seeded generator, each with its own seed:
no two share a prefix, so no prompt cache can serve one from another. Their length in tokens
is calibrated once on the server itself (a one-token completion's `usage.prompt_tokens`).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ..errors import MacserveError
from ..sizing.held import TreeSampler, wait_settled
from . import baseline, providers
from .profiles import Profile, ProfileStore
from .share import Share, record_baseline, share_of
from .supervisors.base import package_root

_WORDS = (
    "the of and to in is that it was for on are as with his they at be this from have or "
    "one had by word but not what all were we when your can said there use each which she "
    "do how their if will up other about out many then them these so some her would make "
    "like him into time has look two more write go see number no way could people my than "
    "first water been call who oil its now find long down day did get come made may part "
    "king lord night crown sword heaven father sea storm ghost queen answer strange ship"
)
WORDS = _WORDS.split()
READY_SECS = 180.0  # a model's load on a busy 2-core machine


@dataclass(frozen=True)
class Load:
    clients: int  # at once, in each batch phase
    prompt_tokens: int  # each prompt's length, about
    answer_tokens: int  # each answer's max_tokens
    cache_prompts: int  # distinct prompts sent one by one to fill the prompt caches


@dataclass
class Result:
    name: str
    provider: str
    share: Share
    idle_bytes: int = 0  # the tree settled after loading, before any request
    peak_bytes: int = 0  # the largest sampled sum of the tree's RSS
    hwm_bytes: int | None = None  # the sum of its processes' VmHWM (Linux)
    samples: int = 0
    phase_peaks: dict[str, int] = field(default_factory=dict)
    answered: int = 0
    refused: int = 0  # 429/503: beyond what the server admits, as it should be
    failed: list[str] = field(default_factory=list)  # anything else
    answer_tokens: int = 0  # generated, over every answer (usage.completion_tokens)
    chars_per_token: float = 1.0
    seconds: dict[str, float] = field(default_factory=dict)  # start, then each phase

    @property
    def share_bytes(self) -> int | None:
        return self.share.share_bytes

    @property
    def ratio(self) -> float | None:
        s = self.share_bytes
        return self.peak_bytes / s if s else None

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "provider": self.provider,
            "share": self.share.as_dict(),
            "share_bytes": self.share_bytes,
            "baseline_bytes": self.share.baseline_bytes,
            "baseline_source": self.share.baseline_source,
            "idle_bytes": self.idle_bytes,
            "peak_bytes": self.peak_bytes,
            "hwm_bytes": self.hwm_bytes,
            "peak_over_share": None if self.ratio is None else round(self.ratio, 3),
            "samples": self.samples,
            "phase_peaks": self.phase_peaks,
            "answered": self.answered,
            "refused": self.refused,
            "failed": self.failed,
            "answer_tokens": self.answer_tokens,
            "seconds": self.seconds,
        }


def prompt(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return f"{seed}: " + " ".join(rng.choice(WORDS) for _ in range(words))


@contextlib.contextmanager
def running(profile: Profile, log: Path, timeout: float = READY_SECS) -> Iterator[int]:
    """The profile saved and run as a service runs it (`macserve run NAME`), until ready;
    yields the root pid; stopped (SIGTERM to its group, then SIGKILL) on the way out."""
    ProfileStore().save(profile)
    prov = providers.for_profile(profile)
    variables = dict(os.environ, PYTHONUNBUFFERED="1")
    root = package_root()
    if root is not None:  # the code under test, not whatever is installed
        variables["PYTHONPATH"] = os.pathsep.join(
            [str(root), *filter(None, [variables.get("PYTHONPATH")])]
        )
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "macserve", "run", profile.name],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=variables,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + timeout
        while not prov.ready(profile):
            if proc.poll() is not None:
                tail = log.read_text(errors="replace").splitlines()[-15:]
                raise MacserveError(
                    f"{profile.name}: the server exited ({proc.returncode}) before it was "
                    f"ready; its log {log}:\n" + "\n".join(tail)
                )
            if time.monotonic() > deadline:
                raise MacserveError(f"{profile.name}: not ready after {timeout:.0f}s ({log})")
            time.sleep(0.3)
        yield proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


class Driver:
    """Completions against one server, counted into a Result."""

    def __init__(self, url: str, res: Result):
        self.url = url + "/v1/completions"
        self.res = res
        self.lock = threading.Lock()

    def complete(self, text: str, max_tokens: int, timeout: float = 600.0) -> dict | None:
        body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "stream": False}
        try:
            r = httpx.post(self.url, json=body, timeout=timeout)
        except httpx.HTTPError as e:
            with self.lock:
                self.res.failed.append(f"{type(e).__name__}: {e}")
            return None
        with self.lock:
            if r.status_code == 200:
                out = r.json()
                self.res.answered += 1
                self.res.answer_tokens += int(
                    (out.get("usage") or {}).get("completion_tokens") or 0
                )
                return out
            if r.status_code in (429, 503):
                self.res.refused += 1
            else:
                self.res.failed.append(f"{r.status_code}: {r.text[:200]}")
        return None

    def calibrate(self) -> float:
        """Characters per token of these prompts, as the server's tokenizer counts them."""
        text = prompt(0, 40)
        out = self.complete(text, 1)
        n = ((out or {}).get("usage") or {}).get("prompt_tokens")
        return len(text) / n if n else 1.0

    def batch(self, seeds: list[int], words: int, answer: int) -> None:
        threads = [
            threading.Thread(target=self.complete, args=(prompt(s, words), answer)) for s in seeds
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def measure_baseline(profile: Profile, log: Path) -> str:
    """What the first start on a machine stores (share.record_baseline, called as soon as a
    start is ready, as health.wait_ready calls it): one start, stopped once it has; returns
    the baseline's source ("measured <date>")."""
    source = share_of(profile).baseline_source
    if source != baseline.ASSUMED:
        return source  # stored by an earlier start
    with running(profile, log) as pid:
        record_baseline(profile, pid)
    return share_of(profile).baseline_source


def drive(
    profile: Profile,
    load: Load,
    log: Path,
    progress: Callable[[str], None] = lambda m: None,
    before_stop: Callable[[str], None] | None = None,
) -> Result:
    """Run the profile's server, drive it (the module docstring), and say what it held.
    `before_stop(base URL)`: once driven, while the server still runs (what it reports)."""
    share = share_of(profile)
    res = Result(profile.name, profile.provider, share)
    progress(f"{profile.name}: starting {profile.provider}")
    t = time.monotonic()
    with running(profile, log) as pid:
        res.seconds["start"] = round(time.monotonic() - t, 1)
        res.idle_bytes = wait_settled(pid)
        drv = Driver(providers.base_url(profile), res)
        with TreeSampler(pid) as sampler:
            res.chars_per_token = drv.calibrate()
            # words average about 4.6 characters with their space; the seed prefix aside
            words = max(1, int(load.prompt_tokens * res.chars_per_token / 4.6))
            seed = 1
            for i, phase in enumerate(("batch", "cache", "batch full")):
                if i:  # the first phase's peak includes the calibration's request
                    sampler.reset_peak()
                t = time.monotonic()
                if phase == "cache":
                    progress(f"{profile.name}: {load.cache_prompts} distinct prompts, in turn")
                    for s in range(seed, seed + load.cache_prompts):
                        drv.complete(prompt(s, words), 1)
                    seed += load.cache_prompts
                else:
                    progress(f"{profile.name}: {load.clients} clients at once ({phase})")
                    drv.batch(list(range(seed, seed + load.clients)), words, load.answer_tokens)
                    seed += load.clients
                res.phase_peaks[phase] = sampler.peak_bytes
                res.seconds[phase] = round(time.monotonic() - t, 1)
        if before_stop is not None:
            before_stop(providers.base_url(profile))
        res.peak_bytes = max(res.phase_peaks.values())
        res.hwm_bytes = sampler.hwm_bytes
        res.samples = sampler.samples
    return res
