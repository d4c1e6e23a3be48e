"""How many parameter elements DeepSpeed ZeRO-3 holds gathered (whole, beside each rank's partition) as backward
begins, where the activations peak: what its parameter coordinator keeps, read from DeepSpeed 0.19.8's
runtime/zero/partitioned_param_coordinator.py (fetch_sub_module, release_sub_module, __params_to_release) and
checked against it (tests/integration/test_zero3_gathered.py, docs/results/zero3-gathered-2026-12-07.md).

ZeRO-3 gathers a module's own parameters when the module runs and releases them after it, unless they are used
again within `max_reuse_distance` elements of the modules that follow. At the end of forward the head runs and
backward runs it again at once: it stays gathered, with the last modules whose reuse (the rest of forward, then
backward back to them) is that near. At every module's call, parameters or not, the coordinator also prefetches
the next modules' parameters, so it runs ahead until the parameters gathered reach `max_live_parameters`: as
backward begins, backward's next weights are gathered up to that limit. (Where the prefetch bucket is small against
the modules, it may not have run that far ahead yet: this is then an upper bound.) A model whose forward and
backward fit in the reuse distance keeps every parameter gathered through the step. Parameters of at most
`param_persistence_threshold` elements (the norms) are never partitioned. raybench's ds_config leaves these
settings at DeepSpeed's defaults (deepspeed/runtime/zero/config.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from raybench.spec.presets import ModelShape


@dataclass(frozen=True)
class Zero3Settings:
    """DeepSpeed's ZeRO-3 settings that decide what is gathered, in parameter elements (its defaults)."""

    max_live_parameters: int = 1_000_000_000  # stage3_max_live_parameters
    max_reuse_distance: int = 1_000_000_000  # stage3_max_reuse_distance
    param_persistence_threshold: int = 100_000  # stage3_param_persistence_threshold


def forward_modules(shape: ModelShape, projections: dict[str, tuple[int, int]], biased: tuple[str, ...],
                    adapters_rank: int, targets: tuple[str, ...]) -> list[int]:
    """Each module's own parameter elements, in the order a Llama-layout forward runs them: the embedding, per
    block its input norm, q, k, v and o, the post-attention norm, gate, up and down (a LoRA target: its base, then
    its A and B), the final norm and the head. A head tied to the embedding is the embedding's tensor: counted
    once, at the head."""
    h = shape.hidden_size
    block = [h]
    for name, (fan_in, fan_out) in projections.items():
        if name == "gate_proj":
            block.append(h)  # the post-attention norm runs between attention and the MLP
        block.append(fan_in * fan_out + (fan_out if name in biased else 0))
        if name in targets:
            block += [adapters_rank * fan_in, adapters_rank * fan_out]
    embedding = 0 if shape.tie_word_embeddings else shape.vocab_size * h
    return [embedding, *block * shape.num_hidden_layers, h, shape.vocab_size * h]


def gathered_at_backward(modules: list[int], settings: Zero3Settings = Zero3Settings()) -> int:
    """Parameter elements held whole as backward begins (see the module doc): the persistent parameters, the last
    modules of forward reused within the reuse distance (at least the head), and backward's next parameters, whole,
    while they fit under the live limit."""
    persistent = sum(n for n in modules if n <= settings.param_persistence_threshold)
    partitioned = [n for n in modules if n > settings.param_persistence_threshold]
    kept, held = 0, 0
    for n in reversed(partitioned):
        # Released unless its reuse comes within the distance: the rest of forward, then backward back to it.
        if 2 * held >= settings.max_reuse_distance:
            break
        kept, held = kept + 1, held + n
    for n in reversed(partitioned[:len(partitioned) - kept]):
        if held + n > settings.max_live_parameters:
            break
        held += n
    return persistent + held
