"""`/metrics` on a real `macserve serve` subprocess: behind the API key, parsed with
prometheus_client's own text parser, its counters moving as the official clients make
requests (requests by route and status, tokens, TTFT, prompt-cache reuse), and the batch
size sized at load when --max-batch is not given. With --memory: MLX's allocator and the
share as gauges, /health's breakdown of the share, everything held inside it."""

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .serverproc import serve

pytestmark = pytest.mark.e2e

KEY = "sekrit"
SYSTEM = "You are a terse assistant who answers in the manner of a Shakespearean clown. " * 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("serve-metrics"), "--api-key", KEY) as s:
        yield s


def scrape(server) -> dict:
    """{(name, labels as a sorted tuple): value} for every sample."""
    r = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def get(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_needs_the_key(server):
    assert httpx.get(server.url + "/metrics").status_code == 401
    r = httpx.get(server.url + "/metrics", headers={"x-api-key": KEY})
    assert r.status_code == 200 and "macserve_requests_total" in r.text


def test_counters_move_with_requests(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    before = scrape(server)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who art thou?"}]
    a = c.chat.completions.create(model="m", messages=msgs, max_tokens=8, temperature=0)
    msgs2 = msgs[:1] + [{"role": "user", "content": "And whither goest thou?"}]
    b = c.chat.completions.create(model="m", messages=msgs2, max_tokens=8, temperature=0)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    after = scrape(server)

    def moved(name, **labels):
        return get(after, name, **labels) - get(before, name, **labels)

    route = "/v1/chat/completions"
    assert moved("macserve_requests_total", route=route, status="200") == 2
    assert moved("macserve_requests_total", route="/v1/models", status="401") == 1
    prompt = a.usage.prompt_tokens + b.usage.prompt_tokens
    assert moved("macserve_prompt_tokens_total") == prompt
    gen = a.usage.completion_tokens + b.usage.completion_tokens
    assert moved("macserve_generation_tokens_total") == gen
    assert moved("macserve_time_to_first_token_seconds_count") == 2
    assert moved("macserve_decode_tokens_per_second_count") == 2
    # The second shares the system prompt: a memory hit for exactly what usage reports.
    reused = b.usage.prompt_tokens_details.cached_tokens
    assert reused > 0
    assert moved("macserve_prompt_cache_hits_total", tier="memory") >= 1
    got = moved("macserve_prompt_cache_tokens_reused_total", tier="memory")
    assert got == reused + a.usage.prompt_tokens_details.cached_tokens
    assert get(after, "macserve_prompt_cache_bytes", tier="memory") > 0
    assert get(after, "macserve_queue_depth") == 0
    assert get(after, "macserve_sequences_in_flight") == 0


def test_the_batch_is_sized_at_load_without_max_batch(server):
    """This machine's RAM holds far more than 8 of the demo model's 1,024-token caches: the
    cap, and the log says how it was sized."""
    m = scrape(server)
    assert get(m, "macserve_max_batch") == server.health()["max_batch"] == 64
    assert "--max-batch 64:" in server.log.read_text()


def test_a_running_stream_shows_in_flight_with_its_kv_bytes(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    msgs = [{"role": "user", "content": "Speak at length of the sea."}]
    stream = c.chat.completions.create(
        model="m", messages=msgs, max_tokens=400, temperature=0, stream=True
    )
    seen = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            m = scrape(server)  # refreshed every 0.5 s while sequences run
            if get(m, "macserve_kv_bytes_in_use") > 0:
                seen = m
                break
    stream.close()
    assert seen is not None, "no scrape during the stream saw its caches"
    assert get(seen, "macserve_sequences_in_flight") == 1


SHARE = 256 * 2**20  # the demo model (weights ~21 MB, 2.5 MB per 1,024-token sequence)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("serve-share"), "--memory", "256MB", "--api-key", KEY) as s:
        yield s


def test_a_share_sizes_the_server_and_its_gauges_show_mlx_within_it(shared):
    c = openai.OpenAI(base_url=shared.url + "/v1", api_key=KEY, max_retries=0)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who art thou?"}]
    c.chat.completions.create(model="m", messages=msgs, max_tokens=16, temperature=0)
    mem = shared.health()["memory"]
    assert mem["source"] == "--memory" and mem["share_bytes"] == SHARE
    parts = ("baseline_bytes", "weights_bytes", "kv_bytes", "prompt_cache_bytes", "reserve_bytes")
    assert sum(mem[p] for p in parts) + mem["free_bytes"] == SHARE and mem["free_bytes"] >= 0
    # the share, not the machine, bounds the batch: below the cap a bare serve reaches here
    assert 1 <= mem["max_batch"] < 64
    # the prompt cache's default bound in a share: one whole-context sequence
    assert mem["prompt_cache_bytes"] == mem["kv_bytes_per_sequence"]
    m = scrape(shared)
    assert get(m, "macserve_max_batch") == mem["max_batch"]
    assert get(m, "macserve_memory_share_bytes") == SHARE
    assert get(m, "macserve_memory_baseline_bytes") == mem["baseline_bytes"] > 0
    active, peak = get(m, "macserve_memory_active_bytes"), get(m, "macserve_memory_peak_bytes")
    assert mem["weights_bytes"] <= active <= peak <= SHARE - mem["baseline_bytes"]
    # the batch drained: MLX's buffer cache was given back
    assert get(m, "macserve_memory_cache_bytes") <= mem["buffer_cache_bytes"]
    assert "memory share" in shared.log.read_text()


def test_a_bare_serve_says_it_sizes_against_the_whole_machine(server):
    m = scrape(server)
    assert get(m, "macserve_memory_share_bytes") == 0
    assert server.health()["memory"]["source"] == "the machine's memory budget"
    assert "whole machine" in server.log.read_text()
