"""Pipeline ranks with an uneven split, for hosts of different memory.

    use_split([31, 30])          the engine under mlx.launch (model.load)
    python -m macserve.engine.pipeline N1,N2,... [mlx_lm.server arguments]
                                 mlx_lm.server with a split (the mlx provider's SPLIT)

mlx-lm's `PipelineMixin.pipeline(group, split=...)` takes per-rank layer counts, but
`sharded_load` (what `mlx_lm.server --pipeline` calls) never passes one, so every rank gets
an even share. This runs mlx-lm's own server with `split` defaulting to the profile's SPLIT
(rank order = HOSTS order; rank 0 runs the last layers) and logs each rank's layer range.
"""

from __future__ import annotations

import sys

from mlx_lm.models.pipeline import PipelineMixin


def use_split(split: list[int] | None) -> None:
    """From now on mlx-lm's pipeline splits by `split` unless told otherwise (None: mlx-lm's
    even split), and each rank logs its layer range. The macserve engine uses it too."""
    own = getattr(PipelineMixin.pipeline, "_mlx_lm", PipelineMixin.pipeline)

    def pipeline(self, group, split_=None):
        own(self, group, split if split_ is None else split_)
        print(
            f"macserve: pipeline rank {group.rank()} of {group.size()}: layers "
            f"{self.start_idx}-{self.end_idx - 1}",
            file=sys.stderr,
            flush=True,
        )

    pipeline._mlx_lm = own
    PipelineMixin.pipeline = pipeline


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    use_split([int(x) for x in argv[0].split(",")])
    from mlx_lm.server import main as server_main  # only this process entry runs the server

    sys.argv = ["mlx_lm.server", *argv[1:]]
    server_main()


if __name__ == "__main__":
    main()
