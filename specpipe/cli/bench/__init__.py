"""`specpipe bench …`: the benchmarks behind the speed numbers we quote, one module per
command: its options beside the call to its driver in `specpipe.bench`."""

from __future__ import annotations

import click

from specpipe.cli.bench.adaptive_k import bench_adaptive_k
from specpipe.cli.bench.conversation import bench_conversation
from specpipe.cli.bench.draft import bench_draft
from specpipe.cli.bench.draft_head import bench_draft_head
from specpipe.cli.bench.drafting import bench_drafting
from specpipe.cli.bench.exact import bench_exact
from specpipe.cli.bench.faults import bench_faults
from specpipe.cli.bench.load import bench_load
from specpipe.cli.bench.load_api import bench_load_api
from specpipe.cli.bench.long_prompt import bench_long_prompt
from specpipe.cli.bench.parity import bench_parity
from specpipe.cli.bench.reference import bench_reference
from specpipe.cli.bench.ring import bench_ring
from specpipe.cli.bench.soak import bench_soak
from specpipe.cli.bench.stage_memory import bench_stage_memory
from specpipe.cli.bench.taps import bench_taps
from specpipe.cli.bench.trees import bench_trees
from specpipe.cli.bench.wan import bench_wan
from specpipe.cli.bench.web import bench_web


@click.group(name="bench")
def bench() -> None:
    """Benchmarks."""


for command in (
    bench_draft,
    bench_ring,
    bench_load,
    bench_adaptive_k,
    bench_exact,
    bench_faults,
    bench_soak,
    bench_long_prompt,
    bench_conversation,
    bench_load_api,
    bench_wan,
    bench_draft_head,
    bench_trees,
    bench_stage_memory,
    bench_reference,
    bench_taps,
    bench_drafting,
    bench_parity,
    bench_web,
):
    bench.add_command(command)
