"""torch.compile each decoder block in place.

Per-block compilation (as torchtitan does) keeps graphs small, compiles one block shape once and reuses it
for every layer, and composes with FSDP2's per-block hooks; compiling the whole model would graph-break at
every FSDP2 hook. The HF forward must run with use_cache=False or each layer recompiles.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from raybench.runtime.model import decoder_blocks
from raybench.spec.sweep_spec import TrainSpec


def wanted(train: TrainSpec) -> bool:
    return train.compile


def apply(model: nn.Module, train: TrainSpec) -> nn.Module:
    for block in decoder_blocks(model):
        compiled_region(block, train).compile()
    return model


@contextlib.contextmanager
def trial_scope(train: TrainSpec) -> Iterator[None]:
    """What the whole trial (build, warm-up and steps: a block compiles at its first call) runs under, put back
    after it so that a warm pool actor's next trial finds dynamo's settings as a fresh process would.

    A compiled trial fails past dynamo's recompile limit, where a "compiled" block would silently run eager.
    A compiled tensor-parallel trial runs with AOT autograd's on-disk cache off: a warm pool actor that ran
    compiled TP blocks before, other trials in between, crashed in a later compiled TP trial (SIGSEGV in a
    block's first kernel, or AsyncCollectiveTensor's missing `.elem`) in 6 of 6 three-round runs with the cache
    on, and in none with it off (docs/results/warm-fidelity-2026-11-26.md): a cached graph can expect the other
    kind of block input (the collective's wrapper or a plain tensor). Scoped, so the actor's other trials keep
    their cache hits; inductor's own FX graph cache stays on."""
    with contextlib.ExitStack() as scope:
        if train.compile:
            scope.enter_context(torch._dynamo.config.patch(fail_on_recompile_limit_hit=True))
        if train.compile and train.tensor_parallel:
            scope.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
        yield


def compiled_region(block: nn.Module, train: TrainSpec) -> nn.Module:
    """What of a decoder block torch.compile compiles: the block with its checkpoint, so that the compiled graph
    plans the recomputation itself; but inside the checkpoint where a tensor-parallel block is checkpointed whole.

    There torch 2.13 fails the first step ("expected all tensors_saved_with_vc_check to be Tensors"): the
    recomputed attention kernel is a random op (every SDPA kernel is tagged so, for its dropout), whose saved
    random state AOT autograd appends after the block's DeviceMesh, where it expects tensors only
    (tests/unit/test_tp_compile.py pins it). Checkpointing the compiled block keeps the same tensors (the
    block's inputs) and recomputes the same forward. Op-level policies keep attention's output under TP
    (plan.py), so their blocks compile whole."""
    if train.tensor_parallel and train.ac_mode == "block" and isinstance(block, CheckpointWrapper):
        return block._checkpoint_wrapped_module
    return block


# The row columns compiled_since fills (null for eager trials).
COLUMNS = ("compile_graphs", "compile_graph_breaks", "compile_graph_break_reasons_json")


def dynamo_counts() -> tuple[int, Counter]:
    """Dynamo's own counters now: graphs compiled so far, and graph breaks by reason (a process's totals, which
    `torch.compiler.reset` does not clear: a trial reports what changed over its steps, `compiled_since`)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], Counter(counters["graph_break"])


def compiled_since(before: tuple[int, Counter]) -> dict:
    """What dynamo compiled since `before`: graphs, graph breaks, and the breaks' reasons (the most frequent five,
    with their counts). A graph break splits a compiled block in two, and the operators either side of it are
    fused apart (an untraceable kernel call, a print, a data-dependent branch)."""
    graphs, breaks = dynamo_counts()
    breaks = breaks - before[1]
    reasons = {_reason(reason): n for reason, n in breaks.most_common(5)}
    return dict(zip(COLUMNS, (graphs - before[0], sum(breaks.values()), json.dumps(reasons) if reasons else None)))


def _reason(text: str) -> str:
    """Dynamo's reason in one line: its heading and its explanation (the hints and debug context left out)."""
    lines = [line.strip() for line in text.strip().splitlines()]
    explanation = next((line.removeprefix("Explanation:").strip() for line in lines
                        if line.startswith("Explanation:")), None)
    return (f"{lines[0]}: {explanation}" if explanation else lines[0])[:300]
