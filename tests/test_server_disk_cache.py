"""The prompt cache's disk tier end to end, on real `macserve serve --kv int2` subprocesses
with the official openai client: a chat's second turn after a restart prefills only its new
tokens (read from the server's own counters: usage's cached_tokens and /metrics) and answers
what a cold server answers; a corrupt file, a file from another calibration and a disk that
cannot take the write each cost the hit only, with one log line; the size bound holds."""

import resource
import shutil

import httpx
import mlx.core as mx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from macserve.server.disk_identity import STORE

from .conftest import TINY_MODEL
from .serverproc import serve

pytestmark = pytest.mark.e2e

# Plain decoding: the counts below are the plain path's (a drafting request, which --mtp auto
# may start, re-feeds one token and keeps no end-of-generation snapshot: test_mtp_auto.py).
INT2 = ("--kv", "int2", "--mtp", "off")
SYSTEM = (
    "You are the prompter of a company of players. When an actor forgets his line you give "
    "him the next words of the play, no more, and you keep the book open at the scene. "
) * 10  # about 650 tokens with the template: past the INT2 bf16 rows (64 + 512)
TURN1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Line, sir!"}]
FOLLOW = "And the next line after that?"


def _client(s):
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _ask(s, messages, n=16):
    return _client(s).chat.completions.create(
        model="m", messages=messages, max_tokens=n, temperature=0
    )


def _metrics(s) -> dict:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(s.url + "/metrics").text):
        for x in fam.samples:
            out[(x.name, tuple(sorted(x.labels.items())))] = x.value
    return out


def _disk(m, name):
    return m.get((name, (("tier", "disk"),)), 0.0)


def _files(d, kind="*"):
    """Its files: blocks (`b`), tails (`t`, one an entry) or all."""
    return sorted(d.rglob(f"{kind}-*.safetensors" if kind != "*" else "*.safetensors"))


@pytest.fixture(scope="module")
def turn1(tmp_path_factory):
    """Turn 1 on a server that is then stopped: its cache folder, turn 2's messages, turn 1's
    prompt tokens."""
    root = tmp_path_factory.mktemp("disk-turn1")
    with serve(root, *INT2, "--prompt-cache-dir", str(root / "pc")) as s:
        r = _ask(s, TURN1)
    msgs = TURN1 + [
        {"role": "assistant", "content": r.choices[0].message.content},
        {"role": "user", "content": FOLLOW},
    ]
    return root / "pc", msgs, r.usage.prompt_tokens


@pytest.fixture(scope="module")
def cold(tmp_path_factory, turn1):
    """Turn 2 on a server with no disk tier: what every other answer must equal."""
    root = tmp_path_factory.mktemp("disk-cold")
    with serve(root, *INT2, "--prompt-cache-disk", "0") as s:
        r = _ask(s, turn1[1])
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    return r.choices[0].message.content


def _copy(turn1, tmp_path):
    d = tmp_path / "pc"
    shutil.copytree(turn1[0], d)
    return d


def test_the_turn_after_a_restart_prefills_only_its_new_tokens(turn1, cold, tmp_path):
    d = _copy(turn1, tmp_path)
    # One entry (the end-of-prompt snapshot was folded into the end-of-generation one): its
    # tail and its blocks of codes.
    assert len(_files(d, "t")) == 1 and _files(d, "b")
    with serve(tmp_path, *INT2, "--prompt-cache-dir", str(d)) as s:
        before = _metrics(s)
        on_disk = sum(f.stat().st_size for f in _files(d))
        assert _disk(before, "macserve_prompt_cache_bytes") == on_disk
        r = _ask(s, turn1[1])
        m = _metrics(s)
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached >= turn1[2]  # at least turn 1's whole prompt (and most of its answer)
    assert r.usage.prompt_tokens - cached < r.usage.prompt_tokens - turn1[2]
    assert _disk(m, "macserve_prompt_cache_hits_total") == 1
    assert _disk(m, "macserve_prompt_cache_tokens_reused_total") == cached
    assert r.choices[0].message.content == cold


def test_a_corrupt_file_is_skipped_with_one_line(turn1, cold, tmp_path):
    d = _copy(turn1, tmp_path)
    (f,) = _files(d, "t")  # the tail: its blocks alone give back too little to serve
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with serve(tmp_path, *INT2, "--prompt-cache-dir", str(d)) as s:
        r = _ask(s, turn1[1])
        log = s.log.read_text()
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.choices[0].message.content == cold
    lines = [x for x in log.splitlines() if "prompt cache: skipped" in x]
    assert len(lines) == 1 and "checksum" in lines[0] and "Traceback" not in log


def test_a_file_from_another_calibration_is_skipped_with_one_line(turn1, cold, tmp_path):
    # The same rotations under another file (one metadata field differs): another
    # calibration by identity, the same answers.
    arrays, meta = mx.load(str(TINY_MODEL / "latent-rotation.safetensors"), return_metadata=True)
    other = tmp_path / "other-rotation.safetensors"
    mx.save_safetensors(str(other), arrays, {**meta, "note": "refitted"})
    d = _copy(turn1, tmp_path)
    args = (*INT2, "--rotation", str(other), "--prompt-cache-dir", str(d))
    with serve(tmp_path, *args) as s:  # its own folder: the other calibration's file unseen
        r = _ask(s, turn1[1])
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        assert r.choices[0].message.content == cold
        mine = s.health()["prompt_cache"]["tiers"]["disk"]["dir"]
    for f in _files(d):  # this folder now holds only turn 1's tail, from the other calibration
        if str(f.parent) == mine:
            f.unlink()
    for f in _files(d, "t"):
        shutil.copy(f, mine)
    with serve(tmp_path, *args) as s:
        r = _ask(s, turn1[1][:3] + [{"role": "user", "content": "Louder!"}])
        log = s.log.read_text()
    lines = [x for x in log.splitlines() if "prompt cache: skipped" in x]
    assert len(lines) == 1 and "made for calibration" in lines[0], lines
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # turn 1's file was refused


def _small_files():
    # Every file this process writes is cut at 256 KB (EFBIG; Python ignores SIGXFSZ): a disk
    # that cannot take the cache's write, while the server's own short log still fits.
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 2**10, 256 * 2**10))


def test_a_write_the_disk_cannot_take_costs_the_hit_only(turn1, cold, tmp_path):
    d = tmp_path / "pc"
    with serve(tmp_path, *INT2, "--prompt-cache-dir", str(d), preexec_fn=_small_files) as s:
        _ask(s, TURN1)
    log1 = s.log.read_text()  # after the exit: the writes are in the background
    # No entry written (its tail, the window's bf16 rows, is past the limit), no temp file
    # left; the whole blocks of codes written before it stay (a chain of them is entered
    # `recent` tokens back: too few here); the weights' hashes (disk_identity.py) are not cache.
    left = [p for p in d.rglob("*") if p.is_file() and p.name != STORE]
    assert all(p.name.startswith("b-") for p in left)
    with serve(tmp_path, *INT2, "--prompt-cache-dir", str(d)) as s:
        r = _ask(s, turn1[1])
    assert r.usage.prompt_tokens_details.cached_tokens == 0 and r.choices[0].message.content == cold
    lines = [x for x in log1.splitlines() if "not written to disk" in x]
    assert lines and all("File too large" in x for x in lines) and "Traceback" not in log1


def test_the_size_bound_holds(turn1, tmp_path):
    bound = int(2.5 * sum(f.stat().st_size for f in _files(turn1[0])))
    d = tmp_path / "pc"
    args = (*INT2, "--prompt-cache-dir", str(d), "--prompt-cache-disk", f"{bound}B")
    with serve(tmp_path, *args) as s:
        for k in range(5):  # five chats of about the same length, each its own prefix
            msgs = [{"role": "system", "content": f"[{k}] " + SYSTEM}, TURN1[1]]
            _ask(s, msgs)
        m = _metrics(s)
    assert _disk(m, "macserve_prompt_cache_bytes") <= bound
    assert 1 <= len(_files(d, "t")) <= 2 and sum(x.stat().st_size for x in _files(d)) <= bound
