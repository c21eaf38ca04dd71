"""Profiles: the KEY=VALUE format, validation, atomic writes, the lock, and bad input leaving
the disk untouched."""

import os
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from macserve import fileio
from macserve.cli import main
from macserve.errors import MacserveError
from macserve.services import profiles, values
from macserve.services.profiles import Profile, ProfileStore, parse

BASE = {"PROVIDER": "llama.cpp", "MODEL": "/models/a.gguf", "PORT": "8080"}


def snapshot(root):
    """Every file under root with its bytes and mtime: 'nothing changed on disk' means equal."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[p] = (fh.read(), os.stat(p).st_mtime_ns)
    return out


@pytest.mark.e2e
def test_round_trip_keeps_awkward_values():
    values = dict(
        BASE,
        EXTRA_ARGS='-c 8192 --chat-template-kwargs \'{"a": "b c"}\' --alias "it\'s"',
        MODEL="/Volumes/My Models/$HOME/a&b.gguf",
        HOST="0.0.0.0",
    )
    p = Profile("x", values)
    text = p.to_text()
    back = parse(text, "x")
    assert back.values == values
    assert back.extra_args == (
        "-c",
        "8192",
        "--chat-template-kwargs",
        '{"a": "b c"}',
        "--alias",
        "it's",
    )
    # the file is shell-compatible: a shell sourcing it sees the same values
    out = subprocess.run(
        ["sh", "-c", 'set -a; . "$0"; printf "%s\\n" "$MODEL" "$EXTRA_ARGS"', "/dev/stdin"],
        input=text,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.splitlines() == [values["MODEL"], values["EXTRA_ARGS"]]


def test_comments_and_order_survive_an_update():
    text = textwrap.dedent("""\
        # my big model
        MODEL=/m.gguf
        PROVIDER=llama.cpp   # inline comment
        PORT=8080

        # tuned by hand
        EXTRA_ARGS='-c 4096'
    """)
    p = parse(text, "x").updated({"EXTRA_ARGS": "-c 8192 -t 8", "HOST": "0.0.0.0"})
    out = p.to_text()
    assert out.splitlines() == [
        "# my big model",
        "MODEL=/m.gguf",
        "PROVIDER=llama.cpp",
        "PORT=8080",
        "",
        "# tuned by hand",
        "EXTRA_ARGS='-c 8192 -t 8'",
        "HOST=0.0.0.0",
    ]
    # an empty value removes an optional key
    assert "HOST" not in parse(out, "x").updated({"HOST": ""}).values


def test_defaults():
    p = parse("PROVIDER=mlx\nMODEL=org/repo\nPORT=9000\n", "x")
    assert p.host == "127.0.0.1" and p.port == 9000 and p.extra_args == ()


@pytest.mark.parametrize(
    "text, msg",
    [
        ("PROVIDER=llama.cpp\nMODEL=a\nPORT=8080\nCOLOUR=red\n", "unknown key COLOUR"),
        ("PROVIDER=llama.cpp\nMODEL=a\nPORT=0\n", "bad PORT '0'"),
        ("PROVIDER=llama.cpp\nMODEL=a\nPORT=65536\n", "bad PORT '65536'"),
        ("PROVIDER=llama.cpp\nMODEL=a\nPORT=80a\n", "bad PORT '80a'"),
        ("PROVIDER=vllm\nMODEL=a\nPORT=8080\n", "unknown provider 'vllm'"),
        ("PROVIDER=llama.cpp\nPORT=8080\n", "MODEL is required"),
        (
            "PROVIDER=llama.cpp\nMODEL=a\nPORT=8080\nEXTRA_ARGS='-c 1\n",
            "line 4: EXTRA_ARGS: No closing quotation",
        ),
        (
            "PROVIDER=llama.cpp\nMODEL=a\nPORT=8080\nEXTRA_ARGS=-c 1\n",
            "line 4: EXTRA_ARGS has several words",
        ),
        (
            "PROVIDER=llama.cpp\nMODEL=a\nPORT=8080\nthis is not a pair\n",
            "line 4: expected KEY=VALUE",
        ),
        ("PROVIDER=llama.cpp\nMODEL=a\nPORT=8080\nHOSTS='a:1,b c'\n", "bad HOSTS entry 'b c'"),
        ("PROVIDER=llama.cpp\nMODEL=a\nPORT=8080\nHOSTS=a:99999\n", "bad HOSTS '99999'"),
        ("PROVIDER=llama.cpp\nMODEL=a\nPORT=8080\nBACKEND=carrier-pigeon\n", "unknown BACKEND"),
        ("PROVIDER=llama.cpp\nMODEL=a\nPORT=8080\nPARALLEL=0\n", "bad PARALLEL '0'"),
        ("PROVIDER=llama.cpp\nMODEL=a\nPORT=8080\nMEMORY=lots\n", "bad MEMORY: not a size"),
        ("PROVIDER=llama.cpp\nMODEL=a\nPORT=8080\nMEMORY=24\n", "bad MEMORY: '24' needs a"),
        ("PROVIDER=llama.cpp\nMODEL=a\nPORT=8080\nHOST='a b'\n", "bad HOST 'a b'"),
    ],
)
def test_validation_errors_are_one_line(text, msg):
    with pytest.raises(MacserveError) as e:
        parse(text, "x")
    assert msg in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["", "-x", "a/b", "../up", "a b", "x" * 65, "a:b", "n.env"])
def test_bad_names(name):
    with pytest.raises(MacserveError, match="bad profile name"):
        ProfileStore().path(name)


def test_multi_mac_keys_validate():
    p = parse(
        "PROVIDER=llama.cpp\nMODEL=a\nPORT=8080\nHOSTS=studio1:50052,studio2\nBACKEND=rpc\nPARALLEL=4\n",
        "x",
    )
    assert p.values["HOSTS"] == "studio1:50052,studio2"


def test_atomic_write_keeps_old_file_when_the_write_fails(monkeypatch, macserve_home):
    st = ProfileStore()
    st.save(Profile("a", dict(BASE)))
    before = snapshot(macserve_home)

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(fileio.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        st.save(Profile("a", dict(BASE, PORT="9090")))
    assert snapshot(macserve_home) == before  # old content, and no temp file left behind
    assert st.load("a").port == 8080


def test_invalid_profile_is_never_written(macserve_home):
    st = ProfileStore()
    st.save(Profile("a", dict(BASE)))
    before = snapshot(macserve_home)
    with pytest.raises(MacserveError):
        st.save(Profile("a", dict(BASE, PORT="nope")))
    assert snapshot(macserve_home) == before


@pytest.mark.e2e
def test_lock_serializes_concurrent_read_modify_write(macserve_home):
    """Four processes each increment PARALLEL 15 times under the lock: no update is lost."""
    st = ProfileStore()
    st.save(Profile("c", dict(BASE, PARALLEL="1")))
    code = textwrap.dedent("""
        from macserve.services.profiles import ProfileStore
        st = ProfileStore()
        for _ in range(15):
            with st.lock("c"):
                p = st.load("c")
                st.save(p.updated({"PARALLEL": str(int(p.values["PARALLEL"]) + 1)}))
    """)
    env = dict(os.environ, PYTHONPATH=str(__import__("pathlib").Path(profiles.__file__).parents[1]))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0, 0]
    assert st.load("c").values["PARALLEL"] == "61"


def test_lock_blocks_a_second_holder(macserve_home):
    import fcntl

    st = ProfileStore()
    with st.lock("z"), open(st.dir / ".z.lock", "a") as f, pytest.raises(BlockingIOError):
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(st.dir / ".z.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again


# ---- the CLI: bad input gives one line and changes nothing ----------------------------------


def _cli(*args):
    r = CliRunner().invoke(main, list(args))
    return r.exit_code, r.stdout, r.stderr


@pytest.mark.parametrize(
    "args, msg",
    [
        (["set", "a", "--", "PORT=0"], "bad PORT '0'"),
        (["set", "a", "--", "COLOUR=red"], "unknown key COLOUR"),
        (["set", "a", "--", "PROVIDER=vllm"], "unknown provider 'vllm'"),
        (["set", "a", "--", "EXTRA_ARGS=-c '8192"], "EXTRA_ARGS does not parse"),
        (["set", "a", "--", "MODEL="], "MODEL is required"),
        (["set", "a", "PORT"], "expected KEY=VALUE ... or KEY VALUE"),
        (["set", "a"], "nothing to set"),
        (["set", "nope", "PORT", "9000"], "no profile 'nope'"),
        (["set", "../etc", "PORT", "9000"], "bad profile name"),
        (["show", "nope"], "no profile 'nope'"),
        (["start", "nope"], "no profile 'nope'"),
        (["stop", "a"], "service a is not installed"),
        (["rm", "nope"], "no profile 'nope'"),
        (["logs", "a"], "no log yet for a"),
        (["new", "/nonexistent/model.gguf", "--no-start"], "no such file"),
    ],
)
def test_cli_bad_input_one_line_nothing_changes(args, msg, macserve_home):
    ProfileStore().save(Profile("a", dict(BASE)))
    before = snapshot(macserve_home)
    code, out, err = _cli(*args)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], err
    assert snapshot(macserve_home) == before


@pytest.mark.e2e
def test_cli_set_no_restart_writes(macserve_home, llama_server, tmp_path):
    model = tmp_path / "a.gguf"
    model.write_bytes(b"GGUF")  # set checks that the file exists, not what is in it
    ProfileStore().save(Profile("a", dict(BASE, MODEL=str(model))))
    code, out, err = _cli("set", "a", "port", "9001", "--no-restart")
    assert code == 0, err
    assert ProfileStore().load("a").port == 9001
    code, out, err = _cli("set", "a", "--no-restart", "--", "EXTRA_ARGS=-c 2048 --alias 'my model'")
    assert code == 0, err
    # -c is the CTX key now: lifted out of EXTRA_ARGS, with a note
    a = ProfileStore().load("a")
    assert (a.ctx, a.extra_args) == (2048, ("--alias", "my model"))
    assert "moved -c 2048 out of EXTRA_ARGS into CTX=2048" in out + err
    before = snapshot(macserve_home / "profiles")
    for bad, msg in [
        ("EXTRA_ARGS=-c 2048 --no-such-flag", "llama-server does not accept --no-such-flag"),
        ("EXTRA_ARGS=--alias", "--alias expects a value"),
        ("EXTRA_ARGS=-c", "-c is set by macserve from the profile; use the CTX key"),
        ("KV=q9_9", "KV q9_9: llama-server caches f16 | q8_0 | q4_0 | bf16"),
        ("CTX=0", "bad CTX '0': expected context tokens, a positive integer"),
        ("EXTRA_ARGS=--port 9", "--port is set by macserve from the profile; use the PORT key"),
        (f"MODEL={tmp_path}/missing.gguf", "not found"),
    ]:
        code, out, err = _cli("set", "a", "--no-restart", "--", bad)
        assert code == 2 and len(err.strip().splitlines()) == 1 and msg in err, err
    assert snapshot(macserve_home / "profiles") == before


def test_example_profiles_in_the_repo_parse():
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[1] / "profiles").glob("*.env"))
    assert {f.stem for f in files} >= {"tiny-mla", "glm-5.3-flash"}
    for f in files:
        p = parse(f.read_text(), f.stem)
        assert p.provider in values.PROVIDER_NAMES and p.extra_args is not None


# ---- secrets, single-flag edits -----------------------------------------------------------


def test_secrets_file_is_0600_and_round_trips(macserve_home):
    st = ProfileStore()
    st.save(Profile("a", dict(BASE)))
    st.save_secrets("a", {"API_KEY": "sk-a1", "HF_TOKEN": "hf_b2"})
    path = st.secrets_path("a")
    assert (path.stat().st_mode & 0o777) == 0o600
    assert st.load_secrets("a") == {"API_KEY": "sk-a1", "HF_TOKEN": "hf_b2"}
    assert "sk-a1" not in st.path("a").read_text()
    path.chmod(0o644)  # widened by a copy or an editor: narrowed again when read
    st.load_secrets("a")
    assert (path.stat().st_mode & 0o777) == 0o600
    assert st.names() == ["a"]
    with pytest.raises(
        MacserveError, match="API_KEY: expected printable ASCII without spaces"
    ) as e:
        st.save_secrets("a", {"API_KEY": "two words"})
    assert "two words" not in str(e.value)  # a secret is never echoed
    st.save_secrets("a", {})
    assert not path.exists()
    st.save_secrets("a", {"API_KEY": "sk-a1"})
    st.delete("a")
    assert not path.exists()


def test_parse_assignments_secrets_and_flag_edits():
    from macserve.services.edit import Changes, parse_assignments

    c = parse_assignments(("API_KEY=sk-1", "port=9000", "EXTRA_ARGS+=-c 512 --jinja"))
    assert c == Changes({"PORT": "9000"}, {"API_KEY": "sk-1"}, ("-c", "512", "--jinja"), ())
    assert parse_assignments(("EXTRA_ARGS-=--jinja",)).drop_args == ("--jinja",)
    with pytest.raises(MacserveError, match="only EXTRA_ARGS takes"):
        parse_assignments(("PORT+=1",))
    with pytest.raises(MacserveError, match="not both"):
        parse_assignments(("EXTRA_ARGS=-c 1", "EXTRA_ARGS+=-c 2"))


@pytest.mark.e2e
def test_set_edits_single_flags_and_names_lost_ones(macserve_home, llama_server, tmp_path):
    model = tmp_path / "a.gguf"
    model.write_bytes(b"GGUF")
    st = ProfileStore()
    st.save(
        Profile("a", dict(BASE, MODEL=str(model), EXTRA_ARGS="-c 1024 --spec-type draft-mtp -t 4"))
    )
    # -t and --threads are one flag (aliases on one --help line): replaced in place; the old
    # profile's -c moves to CTX on this first write
    code, out, err = _cli("set", "a", "--no-restart", "--", "EXTRA_ARGS+=--threads 2 -b 512")
    assert code == 0, err
    a = st.load("a")
    assert a.extra_args == ("--spec-type", "draft-mtp", "--threads", "2", "-b", "512")
    assert a.ctx == 1024 and "moved -c 1024 out of EXTRA_ARGS into CTX=1024" in out
    code, out, err = _cli("set", "a", "--no-restart", "--", "EXTRA_ARGS-=--batch-size")
    assert code == 0, err
    assert st.load("a").extra_args == ("--spec-type", "draft-mtp", "--threads", "2")
    # the slots are PARALLEL now: -np moves into it; the host prompt cache is the share's
    code, out, err = _cli("set", "a", "--no-restart", "--", "EXTRA_ARGS+=-np 2")
    assert code == 0, err
    assert st.load("a").parallel == 2 and "moved -np 2 out of EXTRA_ARGS into PARALLEL=2:" in out
    code, out, err = _cli("set", "a", "--no-restart", "--", "EXTRA_ARGS+=--cache-ram 64")
    assert code == 2 and "--cache-ram is set by macserve from the profile; use the MEMORY" in err
    # replacing the whole value is allowed, and says which flags went
    code, out, err = _cli("set", "a", "--no-restart", "--", "EXTRA_ARGS=-b 512")
    assert code == 0, err
    assert "EXTRA_ARGS no longer has --spec-type draft-mtp, --threads 2" in out
    assert st.load("a").ctx == 1024  # a key, not a flag: EXTRA_ARGS= leaves it


def test_set_api_key_where_the_server_cannot_enforce_it(macserve_home, tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    ProfileStore().save(Profile("m", {"PROVIDER": "mlx", "MODEL": str(folder), "PORT": "8090"}))
    before = snapshot(macserve_home)
    code, out, err = _cli("set", "m", "--", "API_KEY=sk-x")
    assert code == 2
    assert err.strip() == (
        "error: mlx_lm.server has no API key support, so API_KEY would not be enforced: "
        "bind it to HOST=127.0.0.1 (the default) or use PROVIDER=macserve"
    )
    # MODEL is checked for mlx too: a folder with a config.json, or a repo id
    code, out, err = _cli("set", "m", "--", "MODEL=/nonexistent")
    assert (code, err.strip()) == (
        2,
        "error: MODEL /nonexistent: not a model folder with a config.json",
    )
    code, out, err = _cli("set", "m", "--", "MODEL=not a repo")
    assert code == 2 and "neither a model folder nor a repo id" in err
    assert snapshot(macserve_home) == before
