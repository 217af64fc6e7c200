"""`deploykit reshard` and `deploykit verify`: the checkpoint layout on disk, outside any deployment."""

from __future__ import annotations

import click

from ..units import format_size
from .console import EXIT_FAILED, Bar, err, fail, handle_errors, out, show_progress


@click.command()
@click.argument("src", type=click.Path(file_okay=False))
@click.argument("dst", type=click.Path(file_okay=False))
@click.option("--max-shard-size", required=True, metavar="SIZE", help="Largest shard, e.g. 2GiB.")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
              help="Convert floating tensors (decodes a chunk at a time); default: keep each dtype.")
@click.option("--allow-pickle", is_flag=True,
              help="Accept *.bin/*.pt checkpoints (read with torch.load(weights_only=True)).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--tensor-parallel", type=click.IntRange(min=1), default=1, metavar="N",
              help="Write one file per tensor-parallel rank (its slices plus what it replicates) instead; "
                   "needs --dtype.")
@handle_errors
def reshard(src: str, dst: str, max_shard_size: str, dtype: str | None, allow_pickle: bool,
            quiet: bool, tensor_parallel: int) -> None:
    """Rewrite the checkpoint SRC into DST with shards of at most --max-shard-size.

    Streams tensor by tensor with bounded memory, writes atomically (DST is either as it was or
    complete, even after kill -9), resumes an interrupted run, and does nothing when DST is already
    up to date.
    """
    from ..artifacts.reshard import reshard as run
    from ..units import parse_size

    try:
        size = parse_size(max_shard_size)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--max-shard-size") from None
    if size <= 0:
        raise click.BadParameter("must be greater than 0", param_hint="--max-shard-size")
    if tensor_parallel > 1:
        _rank_files(src, dst, tensor_parallel, dtype)
        return
    if show_progress(quiet):
        with Bar("resharding") as bar:
            result = run(src, dst, max_shard_size=size, dtype=dtype, allow_pickle=allow_pickle, progress=bar)
    else:
        result = run(src, dst, max_shard_size=size, dtype=dtype, allow_pickle=allow_pickle)
    for warning in result.warnings:
        err.print(f"warning: {warning}", markup=False)
    if result.status == "unchanged":
        out.print(f"{dst}: up to date ({len(result.layout.shards)} shards), nothing written")
        return
    rate = result.bytes_written / result.seconds / 2**20 if result.seconds else 0
    resumed = f", {result.resumed_shards} resumed" if result.resumed_shards else ""
    out.print(f"{dst}: wrote {len(result.layout.shards)} shards{resumed}, "
              f"{format_size(result.bytes_written)} in {result.seconds:.2f}s ({rate:.0f} MiB/s)")


def _rank_files(src: str, dst: str, ranks: int, dtype: str | None) -> None:
    """``--tensor-parallel N``: the rank files ``apply`` would lay out for ``tensor_parallel: N``."""
    from pathlib import Path

    from ..artifacts.rank_shards import rank_layout, write_rank_shards
    from ..model.checkpoint import open_checkpoint

    if dtype is None:
        raise click.BadParameter("rank files are written at one dtype: give --dtype", param_hint="--dtype")
    checkpoint = open_checkpoint(Path(src))
    written = write_rank_shards(checkpoint, Path(dst), rank_layout(checkpoint, ranks=ranks, dtype=dtype))
    files = sorted(written.glob("rank-*.safetensors"))
    out.print(f"{dst}: {len(files)} rank files, {format_size(sum(f.stat().st_size for f in files))}")


@click.command()
@click.argument("directory", type=click.Path(file_okay=False))
@handle_errors
def verify(directory: str) -> None:
    """Check a resharded checkpoint: every shard against the lock file, the index against the files.

    Exit 0 when everything matches, 1 otherwise.
    """
    from ..artifacts.verify import verify as check

    problems = check(directory)
    if problems:
        fail(EXIT_FAILED, problems)
    out.print(f"{directory}: verified")
