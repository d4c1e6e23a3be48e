"""`raybench rehearse`: one CPU process traces a trial's step as rank 0 of its full world (fake tensors, fake
process group). Its per-rank tensor memory matches the same trial run for real on gloo ranks
(tests/integration/test_rehearse_real_ranks.py), and the private torch pieces raybench/rehearse/ relies on are
pinned here so that a torch upgrade fails loudly."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from raybench.cli.main import main
from raybench.planning import estimate
from raybench.planning.plan import plan
from raybench.rehearse import (
    compiled,
    fake_world,
    fitted,
    nccl,
    policy,
    rehearsal,
    roofline,
    step_time,
    step_tracker,
    trace,
    traced_model,
)
from raybench.rehearse.choice import predicted_best
from raybench.results import rehearsals
from raybench.runtime import limits
from raybench.runtime.strategies import RankContext
from raybench.runtime.techniques import fp8
from raybench.spec.load import load_sweep, parse_sweep
from raybench.spec.presets import PRESETS
from raybench.spec.schema import GIB

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compiled_blocks import saved_by_real_inductor  # noqa: E402
from rehearse_cases import TINY_TRAIN, fake_trace, real_trace, tiny_trial  # noqa: E402


def test_liger_is_traced_under_every_traced_strategy():
    """Liger's reference operators take plain tensors, and under Liger tensor parallelism leaves the norms, the
    embedding and the head whole (no sequence parallelism), so every traced strategy traces a Liger trial; the
    fake ranks match real ones (tests/integration/test_rehearse_real_ranks.py: ddp, fsdp2, tp; tp_fsdp2 matched 4 real gloo ranks to the byte,
    docs/results/rehearse-2026-11-26.md §9)."""
    for world, train in ((2, {"strategy": "fsdp2"}), (2, {"strategy": "ddp"}), (2, {"strategy": "tp", "tp_size": 2}),
                         (4, {"strategy": "tp_fsdp2", "tp_size": 2})):
        assert rehearsal.why_not_traceable(tiny_trial(world, liger=True, **train).config) is None


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_bf16_lora_base_halves_the_rehearsed_base_weights(strategy):
    """The trace builds the model through the LoRA technique, so a base stored in bf16 (auto under bf16 compute)
    rests in half the bytes of an fp32 one; the fp32 adapters and their optimizer state do not change."""
    def resident(base_dtype: str) -> tuple:
        trial = tiny_trial(1, strategy=strategy, finetune="lora", lora={"base_dtype": base_dtype})
        return trial, fake_trace(trial).resident_gib

    trial, bf16 = resident("auto")
    _, fp32 = resident("fp32")
    counts = estimate.param_counts(trial.shape, trial.config.train)
    base = counts.total - counts.adapters
    assert fp32["parameters"] * GIB == pytest.approx(4 * base + 4 * counts.adapters)
    assert bf16["parameters"] * GIB == pytest.approx(2 * base + 4 * counts.adapters)
    assert bf16["optimizer_state"] == fp32["optimizer_state"]


def test_ddp_buckets_count_from_construction():
    """DDP's reducer holds a bucket copy of every trainable gradient (fp32) from construction. At a sequence long
    enough that the step peaks as forward ends, before any gradient exists, the peak holds the buckets and
    nothing else of the gradients'; torch's tracker alone sees them only from their first use in backward (on
    a 1B H100/H200 row that hid 5.6 GiB: docs/rehearse.md, DDP)."""
    trial = tiny_trial(2, strategy="ddp", seq_len=1024)
    fake = fake_trace(trial)
    buckets_gib = 4 * trial.assessment.analytic.params_trainable / GIB
    assert fake.memory_gib["activations"] > 10 * buckets_gib  # the forward's end
    assert fake.memory_gib["gradients"] == pytest.approx(buckets_gib, rel=0.01)


def test_one_ddp_rank_runs_without_the_reducer():
    """One rank has nothing to all-reduce: the trial runs its model unwrapped, with one copy of each gradient
    where two ranks hold the bucket copy beside it, and the trace and the estimate both say so. At this sequence
    length the step peaks as forward ends: two ranks hold the buckets there, one rank no gradient yet."""
    from torch.nn.parallel import DistributedDataParallel

    from raybench.runtime.strategies import ddp

    one, two = (tiny_trial(world, strategy="ddp", seq_len=1024) for world in (1, 2))
    grads_gib = 4 * one.assessment.analytic.params_trainable / GIB
    traced = {world: fake_trace(trial).memory_gib["gradients"] for world, trial in ((1, one), (2, two))}
    assert traced[1] == 0 and traced[2] == pytest.approx(grads_gib, rel=0.01)
    assert one.assessment.analytic.grads_gib == pytest.approx(grads_gib)
    assert two.assessment.analytic.grads_gib == pytest.approx(2 * grads_gib)
    model = torch.nn.Linear(4, 4)
    built = ddp.setup(model, one.config.train, RankContext(0, 1, 0, torch.device("cpu")))
    assert built.model is model and not isinstance(built.model, DistributedDataParallel)


def test_a_tied_output_head_stays_the_embedding(tmp_path):
    """A model whose output head is its embedding (Llama-3.2-1B) holds that weight once, as the worker builds it;
    `Module.to_empty` alone would give the head a copy of its own (on the 1B: 0.98 GiB of fp32 parameters, and
    as much again of gradients, buckets and each AdamW state, under DDP)."""
    from safetensors.torch import save_file

    shape = {**PRESETS["tiny"].hf_config_kwargs(), "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **shape}))
    save_file({"unused": torch.zeros(1)}, str(tmp_path / "model.safetensors"))  # a model directory has weights
    spec = parse_sweep({"name": "rehearse", "model": {"path": str(tmp_path)},
                        "train": {**TINY_TRAIN, "strategy": "ddp"}, "resources": {"workers": 2}})
    (trial,) = plan(spec)
    fake = fake_trace(trial)
    assert fake.resident_gib["parameters"] * GIB == 4 * trial.assessment.analytic.params_total


def test_ddp_hook_leaves_the_real_bucket_untouched():
    """DDP's reducer allocates its buckets outside the fake mode (real host memory, a copy of every trainable
    gradient): the trace's hook must not write them, or a 1B trial's rehearsal holds 5 GiB more for real."""

    class Bucket:
        def __init__(self):
            self.tensor = torch.full((1024,), 3.0)

        def buffer(self):
            return self.tensor

    bucket = Bucket()
    fake_world.init_fake_world(0, 8)
    try:
        with fake_world.fake_mode():
            assert fake_world.fake_allreduce_hook(None, bucket).wait() is bucket.tensor
    finally:
        dist.destroy_process_group()
    assert torch.equal(bucket.tensor, torch.full((1024,), 3.0))


def test_tracker_counts_dtensor_propagation_without_the_correction():
    """Pins why `Propagation` exists: under an active FakeTensorMode, DTensor's sharding propagation runs a
    foreach op once more on fake tensors of the global shape, and torch's tracker counts them as this rank's
    memory. When this starts failing, torch fixed it and the correction can go."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    world, rows, cols, count = 8, 1024, 256, 4
    fake_world.init_fake_world(0, world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        peaks = {}
        with fake_world.fake_mode():
            xs = [DTensor.from_local(torch.empty(rows // world, cols), mesh, [Shard(0)]) for _ in range(count)]
            for corrected in (False, True):
                DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
                ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
                tracker = step_tracker.tracker_for(None, None, fsdp=False, roofline=roofline.gpu_roofline(None))
                marking = fake_world.marking_propagation(tracker.propagation) if corrected else contextlib.nullcontext()
                with marking, tracker:
                    ys = torch._foreach_mul(xs, 2.0)
                    del ys
                peaks[corrected] = sum(v for s in tracker.get_tracker_snapshot("peak").values()
                                       for k, v in s.items() if k == "Total")
    finally:
        dist.destroy_process_group()
    local_bytes = count * rows // world * cols * 4
    assert peaks[True] == local_bytes  # the outputs: this rank's shards only
    assert peaks[False] >= local_bytes + count * rows * cols * 4  # plus phantom global-shape outputs


def test_collectives_are_counted_per_step():
    """FSDP2 in fp32 on 2 ranks: the reduce-scatter moves every gradient once (4 bytes per parameter); the
    all-gathers move every weight twice: in forward, and again in backward (reshard_after_forward, the default,
    frees them after forward, the root's too)."""
    trial = tiny_trial(2, strategy="fsdp2", precision="fp32")
    step = fake_trace(trial)
    params = trial.assessment.analytic.params_total
    assert step.comm_bytes["reduce_scatter_base"] == 4 * params
    assert step.comm_bytes["allgather_base"] == 2 * 4 * params
    assert set(step.overlapped_comm) == {"allgather_base", "reduce_scatter_base"}
    assert step.flops > 0


def _block_linear_weights(trial) -> int:
    """Weight elements of the tiny model's decoder-block linears: what train.fp8 converts (its dimensions are
    multiples of 16)."""
    shape = trial.shape
    head_dim = shape.hidden_size // shape.num_attention_heads
    attention = 2 * shape.hidden_size ** 2 + 2 * shape.hidden_size * shape.num_key_value_heads * head_dim
    return shape.num_hidden_layers * (attention + 3 * shape.hidden_size * shape.intermediate_size)


def test_fp8_matmuls_run_at_the_fp8_peak_and_tensorwise_gathers_weights_in_fp8():
    """FSDP2, full fine-tune, bf16 vs FP8 (tensorwise) on an H100 row: the same FLOPs; each block linear's three
    matmuls a token (forward, input and weight gradients: 6 FLOPs a weight) run at the FP8 peak instead of bf16's;
    its weights are all-gathered in FP8, one byte an element instead of two, in forward and again in backward."""
    trials = {recipe: tiny_trial(2, gpus=1, strategy="fsdp2", fp8=recipe) for recipe in ("off", "tensorwise")}
    steps = {recipe: fake_trace(trial, gpu="H100 SXM") for recipe, trial in trials.items()}
    weights, tokens = _block_linear_weights(trials["off"]), TINY_TRAIN["micro_batch"] * TINY_TRAIN["seq_len"]
    bf16, fp8 = steps["off"], steps["tensorwise"]
    assert fp8.flops == bf16.flops
    block_matmul_flops = 6 * weights * tokens
    faster_s = block_matmul_flops * (1 / 989e12 - 1 / 1979e12)  # the H100 SXM's dense bf16 and FP8 peaks
    assert bf16.compute_s - fp8.compute_s == pytest.approx(faster_s, rel=1e-9)
    assert bf16.comm_bytes["allgather_base"] - fp8.comm_bytes["allgather_base"] == 2 * weights
    assert fp8.op_s["abs"] > bf16.op_s.get("abs", 0)  # the scales' amax: memory-bound work FP8 adds


def test_an_fp8_lora_base_runs_the_weight_gradient_it_throws_away():
    """torchao 0.18's Float8Linear computes the weight gradient of a frozen LoRA base too (and keeps its input
    for it) wherever its backward runs: 2 FLOPs a weight a token more than the bf16 base, which skips it. Its
    backward does not run for the first block's q, k and v, whose input (frozen embeddings, frozen norm) carries
    no gradient. If torchao stops doing so, this fails, and fp8.columns and docs/rehearse.md should say so."""
    trials = {recipe: tiny_trial(2, gpus=1, strategy="ddp", finetune="lora", fp8=recipe)
              for recipe in ("off", "rowwise")}
    steps = {recipe: fake_trace(trial, gpu="H100 SXM") for recipe, trial in trials.items()}
    tokens = TINY_TRAIN["micro_batch"] * TINY_TRAIN["seq_len"]
    model, _ = traced_model.unwrapped_model(trials["rowwise"].config)  # the LoRA targets' base linears, converted
    with_backward = {name: weights for name, weights in fp8.converted(model).items()
                     if not re.search(r"\.layers\.0\.self_attn\.[qkv]_proj\.", name)}
    extra = 2 * sum(with_backward.values()) * tokens
    assert steps["rowwise"].flops - steps["off"].flops == extra
    assert steps["rowwise"].memory_gib["activations"] > steps["off"].memory_gib["activations"]
    assert rehearsal.why_not_traceable(trials["rowwise"].config) is None


@pytest.mark.slow  # ~30 s: building 80 decoder blocks dominates
def test_seventy_two_b_layer_traces_without_real_memory():
    """A 72B-shaped trial's memory categories come out at full scale while the process stays small."""
    Path("/proc/self/clear_refs").write_text("5")  # the peak RSS of this process from here on (earlier tests ran)
    spec = parse_sweep({"name": "r", "model": {"preset": "qwen2.5-72b"},
                        "train": {**TINY_TRAIN, "strategy": "fsdp2", "seq_len": 128, "micro_batch": 1},
                        "resources": {"workers": 64, "gpus_per_worker": 1}, "estimate": {"gpu": "H100 SXM"}})
    (trial,) = plan(spec)
    result = rehearsal.rehearse(trial.config, trial.shape, "H100 SXM")
    # 72.7B fp32 parameters over 64 ranks: 4.23 GiB each; AdamW's two moments: twice that.
    assert result.resident_gib["parameters"] == pytest.approx(4.23, rel=0.01)
    assert result.resident_gib["optimizer_state"] == pytest.approx(2 * 4.23, rel=0.01)
    assert limits.proc_status_gib("VmHWM") < 4  # GiB: nothing real was allocated
    assert result.step_time_s > 0 and result.busbw_source == "links"


def test_private_torch_pieces_are_where_rehearse_expects_them():
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    assert hasattr(ShardingPropagator, "_fake_mode_lock")
    # Frozen parameters (LoRA under DDP) are marked as hooked in the tracker's handle table before it hooks them.
    assert hasattr(MemTracker, "_track_module_params_and_buffers")
    assert hasattr(MemTracker(), "_param_to_grad_hook_handles")
    known = set(step_tracker.CATEGORY_OF)
    for reftype in (*_FSDPRefType, *_MemRefType):
        assert reftype.value.lower().replace(" ", "_") in known, reftype
    collectives, overlapped = fake_world.collective_ops()
    assert overlapped <= collectives
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu in roofline.flop_formulas()
    assert roofline._not_memory_traffic()


def test_step_time_overlaps_fsdp_collectives_and_serializes_the_rest():
    step = trace.StepTrace(memory_gib={}, resident_gib={}, comm_bytes={"allgather_base": 100e9,
                           "all_reduce": 1e9}, comm_calls={}, overlapped_comm=("allgather_base",), flops=0,
                           roofline_s=1.0, compute_s=1.0, memory_s=0.0)
    t = step_time.predict_step_time(step, world_size=64, busbw_gbps=50.0, busbw_source="links", efficiency=1.0)
    gather_s = 100e9 * 63 / 64 / 50e9
    reduce_s = 1e9 * 2 * 63 / 64 / 50e9
    assert t.step_time_s == pytest.approx(1.0 + reduce_s + (gather_s - 1.0))
    assert t.comm_s == pytest.approx(gather_s + reduce_s)


def test_nominal_links_are_nvlink_within_its_domain_and_the_domains_nics_beyond():
    # An HGX node's NVLink spans 8 GPUs: beyond, its 8 NICs (50 GB/s each) carry the rings, under NVLink's 450.
    assert step_time.link_busbw_gbps("NVIDIA H100 80GB HBM3", 8) == 450.0
    assert step_time.link_busbw_gbps("NVIDIA H100 80GB HBM3", 64) == 400.0
    assert step_time.link_busbw_gbps("NVIDIA A100-SXM4-80GB", 16) == 200.0
    # GB200 NVL72's NVLink spans the rack's 72 GPUs, so 64 ranks stay on it; beyond, 72 NICs outrun NVLink.
    assert step_time.link_busbw_gbps("NVIDIA GB200", 64) == 900.0
    assert step_time.link_busbw_gbps("NVIDIA GB200", 144) == 900.0
    assert step_time.link_busbw_gbps("NVIDIA B200", 64) == 400.0  # not GB200's row: HGX B200 has 8 per domain
    assert step_time.link_busbw_gbps("NVIDIA GB200", 1) is None
    assert step_time.link_busbw_gbps("Some GPU", 8) is None


def test_a_sweeps_node_layout_places_the_rings():
    """Seed 001's H100 nodes hold 4 GPUs and 4 NICs: 8 ranks already cross the network, at 4 x 50 GB/s."""
    four = step_time.layout_of("H100 SXM", gpus_per_node=4)
    assert four == step_time.Layout(4, 4) and step_time.layout_of("H100 SXM") == step_time.Layout(8, 8)
    assert step_time.link_busbw_gbps("H100 SXM", 4, four) == 450.0
    assert step_time.link_busbw_gbps("H100 SXM", 8, four) == 200.0
    assert step_time.link_busbw_gbps("H100 SXM", 8, step_time.Layout(4, 8)) == 400.0
    assert step_time.layout_of("Some GPU") is None and step_time.layout_of("Some GPU", 4) == step_time.Layout(4, 4)


def test_step_time_pays_the_edge_collectives_latency_and_the_hosts_launches():
    """The first all-gather and the last reduce-scatter have no compute beside them; each call waits its latency;
    a step whose kernels take less than the host's launches is host-bound."""
    step = trace.StepTrace(memory_gib={}, resident_gib={}, comm_bytes={"all_gather_into_tensor": 10e9,
                           "reduce_scatter_tensor": 20e9}, comm_calls={"all_gather_into_tensor": 10,
                           "reduce_scatter_tensor": 5}, overlapped_comm=("all_gather_into_tensor",
                           "reduce_scatter_tensor"), flops=0, roofline_s=1.0, compute_s=1.0, memory_s=0.0,
                           launches=1000)
    layout = step_time.Layout(8, 8)
    t = step_time.predict_step_time(step, world_size=8, busbw_gbps=100.0, busbw_source="set", efficiency=1.0,
                                    layout=layout)
    ring_s = (8.4 + 7 * 3.4) * 1e-6  # NCCL's latency of a ring all-gather or reduce-scatter on 8 NVLink ranks
    gather_s = 10e9 * 7 / 8 / 100e9 + 10 * ring_s
    scatter_s = 20e9 * 7 / 8 / 100e9 + 5 * ring_s
    edges_s = gather_s / 10 + scatter_s / 5
    assert t.comm_s == pytest.approx(gather_s + scatter_s) and t.host_s is None
    assert t.comm_latency_s == pytest.approx(15 * ring_s)
    assert t.comm_algorithms == {"all_gather_into_tensor": "ring", "reduce_scatter_tensor": "ring"}
    assert t.step_time_s == pytest.approx(1.0 + edges_s)  # the rest hides behind 1 s of compute
    host_bound = step_time.predict_step_time(step, world_size=8, busbw_gbps=100.0, busbw_source="set",
                                             efficiency=1.0, launch_s=2e-3, layout=layout)
    assert host_bound.host_s == pytest.approx(2.0) and host_bound.compute_s == pytest.approx(2.0)
    assert host_bound.step_time_s == pytest.approx(2.0 + edges_s)


def _fsdp_part(blocks: int, forward_s: float, backward_s: float) -> list:
    """A micro-batch as FSDP2 issues it: each block's all-gather, then its compute; in backward the gather of
    the block below prefetched before this block's compute, and this block's reduce-scatter after it."""
    events, issued = [], []
    nbytes = {"allgather_base": 150, "reduce_scatter_base": 20}

    def comm(name: str, kind: str) -> int:
        events.append(["comm", name, nbytes[name], kind])
        issued.append(name)
        return len(issued) - 1

    for _ in range(blocks):
        events.append(["compute", forward_s, comm("allgather_base", "gather"), False])
    gathered = comm("allgather_base", "gather")  # the top block's, for its backward
    for b in range(blocks):
        below = comm("allgather_base", "gather") if b < blocks - 1 else None
        events.append(["compute", backward_s, gathered, True])
        comm("reduce_scatter_base", "reduce")
        gathered = below
    return events


def test_collectives_overlap_compute_block_by_block_in_the_traces_order():
    """Compute-bound blocks hide every collective but the first gather and the last reduce-scatter; a block
    whose gather outlasts the compute beside it exposes the difference, block by block."""
    def price(seconds):
        return lambda name, nbytes: seconds[name]

    part = _fsdp_part(4, 1.0, 2.0)
    quick = price({"allgather_base": 0.1, "reduce_scatter_base": 0.2})
    assert step_time.exposed_s(part, 1.0, quick) == pytest.approx(0.1 + 0.2)
    # Forward: gathers of 1.5 s beside blocks of 1 s: the first exposed whole, each later one by 0.5 s. Backward:
    # the top block's gather waits for forward's last one (0.5 s more), then a gather and a reduce-scatter
    # (1.5 + 0.2 s) run beside each block of 2 s, and the last reduce-scatter ends the part.
    slow = price({"allgather_base": 1.5, "reduce_scatter_base": 0.2})
    assert step_time.exposed_s(part, 1.0, slow) == pytest.approx(1.5 + 3 * 0.5 + 0.5 + 0.2)
    # compute_scale prices the trace's roofline seconds: blocks twice as slow hide the later gathers again.
    assert step_time.exposed_s(part, 2.0, slow) == pytest.approx(1.5 + 0.2)
    # A blocking collective (TP's all-reduce) is on the critical path whole.
    blocking = [["compute", 1.0, -1, False], ["comm", "all_reduce", 1, "blocking"], ["compute", 0.0, 0, False],
                ["compute", 1.0, -1, False]]
    assert step_time.exposed_s(blocking, 1.0, price({"all_reduce": 0.3})) == pytest.approx(0.3)


def test_zero2_gathers_the_weights_once_alone_after_the_optimizer_step():
    """ZeRO-1/2 priced from its FSDP2 twin's trace: the twin's gathers leave the micro-batches (their compute
    waits for none), which then expose only their last reduce-scatter, and one micro-batch's gathers run alone
    at the step's end, exposed whole whatever the compute."""
    part, optimizer = _fsdp_part(4, 1.0, 2.0), [["compute", 0.5, -1, False]]
    gathers, reduces = (sum(1 for e in part if e[0] == "comm" and e[1] == name)
                        for name in ("allgather_base", "reduce_scatter_base"))
    per_step = {"allgather_base": 2 * gathers * 150, "reduce_scatter_base": 2 * reduces * 20}
    twin = dataclasses.replace(fake_trace(tiny_trial(2, gpus=1, strategy="fsdp2")), grad_accum=2,
                               timeline=[(2, part), (1, optimizer)], comm_bytes=per_step,
                               comm_calls={"allgather_base": 2 * gathers, "reduce_scatter_base": 2 * reduces})
    zero2 = step_time.gathered_after_step(twin)
    assert zero2.comm_bytes == {"allgather_base": gathers * 150, "reduce_scatter_base": 2 * reduces * 20}
    assert zero2.comm_calls == {"allgather_base": gathers, "reduce_scatter_base": 2 * reduces}
    assert [w for w, _ in zero2.timeline] == [2, 1, 1]
    assert not [e for _, events in zero2.timeline[:2] for e in events if e[0] == "comm" and e[3] == "gather"]
    assert zero2.timeline[2][1] == [["comm", "allgather_base", gathers * 150, "blocking"]]
    # The compute is the twin's, event for event.
    assert [e[1] for e in zero2.timeline[0][1] if e[0] == "compute"] == [e[1] for e in part if e[0] == "compute"]
    seconds = {"allgather_base": 1.5, "reduce_scatter_base": 0.2}
    exposed = sum(w * step_time.exposed_s(events, 1.0, lambda name, nbytes: seconds[name])
                  for w, events in zero2.timeline)
    assert exposed == pytest.approx(2 * 0.2 + 1.5)
    assert step_time.gathered_after_step(dataclasses.replace(twin, timeline=[])).timeline == []


def test_the_step_time_runs_each_parts_timeline_and_the_edges_model_only_without_one():
    """The same collectives by name alone (a rehearsal stored before timelines) hide behind the step's compute
    but for the edges; in the trace's order, the forward gathers that outlast their blocks show."""
    part = _fsdp_part(4, 1.0, 2.0)
    step = trace.StepTrace(memory_gib={}, resident_gib={}, comm_bytes={"allgather_base": 8 * 150,
                           "reduce_scatter_base": 4 * 20}, comm_calls={"allgather_base": 8, "reduce_scatter_base": 4},
                           overlapped_comm=("allgather_base", "reduce_scatter_base"), flops=0, roofline_s=12.0,
                           compute_s=12.0, memory_s=0.0)
    # 2 ranks move half of each buffer: 1.5 s a gather and 0.2 s a reduce-scatter at 50 bytes/s.
    by_name = step_time.predict_step_time(step, 2, 50e-9, "set", efficiency=1.0)
    assert by_name.overlap == step_time.EDGES_OVERLAP
    assert by_name.exposed_comm_s == pytest.approx(1.5 + 0.2)  # the other 11.1 s of collectives hide in 12 s
    ordered = step_time.predict_step_time(dataclasses.replace(step, timeline=[(1, part)]), 2, 50e-9, "set",
                                          efficiency=1.0)
    assert ordered.overlap == step_time.OVERLAP
    assert ordered.exposed_comm_s == pytest.approx(3.7) and ordered.comm_s == by_name.comm_s
    twice = step_time.predict_step_time(dataclasses.replace(step, timeline=[(2, part)], roofline_s=24.0), 2,
                                        50e-9, "set", efficiency=1.0)
    assert twice.exposed_comm_s == pytest.approx(2 * 3.7)  # a part the step runs twice (accumulation)


def test_a_traced_fsdp_step_exposes_less_as_its_links_get_faster():
    """The trace's own timeline: every collective is priced in it, the exposed time never exceeds them all,
    and it falls as the links get faster."""
    t = tiny_trial(2, gpus=1, strategy="fsdp2")
    traces, exposed = {}, []
    for busbw in (0.05, 0.5, 5.0):
        r = rehearsal.rehearse(t.config, t.shape, "H100 SXM", busbw_gbps=busbw, busbw_source="set", traces=traces)
        assert r.overlap == step_time.OVERLAP
        assert 0 < r.exposed_comm_s <= r.comm_s
        exposed.append(r.exposed_comm_s)
    assert exposed[0] > exposed[1] > exposed[2]


def test_tensor_core_peaks_scale_with_measured_matmul_efficiency_relative_to_the_h100():
    def bf16(gpu: str) -> float:
        return roofline.gpu_roofline(gpu).peaks[torch.bfloat16]

    assert bf16("NVIDIA H100 80GB HBM3") == 989e12  # the GPU ROOFLINE_EFFICIENCY was fitted on
    assert bf16("NVIDIA GB200") == pytest.approx(2500e12 * 0.729 / 0.803)
    assert bf16("NVIDIA A100-SXM4-80GB") == pytest.approx(312e12 * 0.869 / 0.803)
    assert bf16("NVIDIA L40S") == 362.05e12  # not measured: the H100's fraction
    assert roofline.gpu_roofline("NVIDIA A100-SXM4-80GB").peaks[torch.float32] == 19.5e12  # no tensor cores


def test_compiled_step_saves_part_of_the_blocks_memory_bound_time():
    step = trace.StepTrace(memory_gib={}, resident_gib={}, comm_bytes={}, comm_calls={}, overlapped_comm=(),
                           flops=0, roofline_s=1.0, compute_s=0.5, memory_s=0.5, block_memory_bound_s=0.4)
    eager = step_time.predict_step_time(step, 1, None, "none", efficiency=1.0)
    fused = step_time.predict_step_time(step, 1, None, "none", efficiency=1.0, compiled_traffic=0.25)
    assert eager.step_time_s == 1.0
    # inductor's kernels move a quarter of the bytes, each at COMPILED_BYTE_COST times an eager byte's price
    assert fused.step_time_s == pytest.approx(0.6 + 0.4 * 0.25 * fitted.COMPILED_BYTE_COST)


def test_inductors_scheduled_bytes_are_what_real_inductor_counts():
    """The generated kernels' bytes come from inductor's own lowering and scheduler run on fake tensors with no
    code generated (_scheduled_bytes); real inductor, compiling and running the same tiny block on CPU, counts
    the same bytes per kernel (its metrics log). Liger's blocks leave compile less to fuse."""
    from torch._inductor import metrics
    from torch._inductor.graph import GraphLowering
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode

    trial = tiny_trial(1, gpus=1, strategy="fsdp2", compile=True, seq_len=128)
    generated = []
    real = contextlib.nullcontext()
    block = compiled.block_and_inputs(trial.config, trial.shape, real)
    counted_by_inductor = []
    original = GraphLowering.count_bytes

    def count_bytes(lowering):  # real inductor's count, its generated kernels only (as _scheduled_bytes)
        counted_by_inductor.append(sum(node.get_read_write_buffers_sizes() for node in lowering.scheduler.nodes
                                       if not isinstance(node, (ExternKernelSchedulerNode, NopKernelSchedulerNode))))
        return original(lowering)

    torch._dynamo.reset()
    torch._logging.set_logs(inductor_metrics=True)  # inductor counts only with its metrics log on
    try:
        with (pytest.MonkeyPatch.context() as patch, torch._inductor.config.patch(fx_graph_cache=False),
              torch._functorch.config.patch(enable_autograd_cache=False)):  # compiled here, not from a cache
            patch.setattr(GraphLowering, "count_bytes", count_bytes)
            out = block.forward(torch.compile(block.module))
            (out[0] if isinstance(out, tuple) else out).sum().backward()
        torch._dynamo.reset()
        mode = fake_world.fake_mode()
        block = compiled.block_and_inputs(trial.config, trial.shape, mode)
        with mode:
            out = block.forward(compiled._partitioned_like_inductor(block.module, generated))
            (out[0] if isinstance(out, tuple) else out).sum().backward()
    finally:
        torch._logging.set_logs()
        metrics.reset()
        torch._dynamo.reset()
    assert len(generated) == 2 and generated == counted_by_inductor  # forward, backward
    plain = compiled.compiled_block_traffic(trial.config, trial.shape)
    assert 0.1 < plain < 0.6
    liger = tiny_trial(1, gpus=1, strategy="fsdp2", compile=True, seq_len=128, liger=True)
    assert compiled.compiled_block_traffic(liger.config, liger.shape) > 1.5 * plain


def test_a_block_inductor_cannot_lower_is_priced_eager(monkeypatch):
    def cannot_lower(*_):
        raise NotImplementedError("no lowering for this operator")

    monkeypatch.setattr(rehearsal, "compiled_block_traffic", cannot_lower)
    compiled_trial = tiny_trial(1, gpus=1, strategy="fsdp2", compile=True)
    rehearsed = rehearsal.rehearse(compiled_trial.config, compiled_trial.shape, "H100 SXM")
    eager = tiny_trial(1, gpus=1, strategy="fsdp2")
    assert rehearsed.step_time_s == rehearsal.rehearse(eager.config, eager.shape, "H100 SXM").step_time_s
    assert rehearsed.compiled_traffic is None
    assert any("step priced eager (NotImplementedError: no lowering" in note for note in rehearsed.notes)


# Each strategy's block as it runs: FSDP2's bf16 weights; ddp's fp32 weights under autocast; tp's projections split
# over 2 ranks under autocast, its input split over the sequence (sequence parallelism); tp_fsdp2's TP shards in
# FSDP2's bf16.
COMPILED_CASES = {"fsdp2": (1, {"strategy": "fsdp2"}), "ddp": (1, {"strategy": "ddp"}),
                  "tp": (2, {"strategy": "tp", "tp_size": 2}), "tp_fsdp2": (4, {"strategy": "tp_fsdp2", "tp_size": 2})}


@pytest.mark.parametrize("case", COMPILED_CASES)
def test_compiled_blocks_keep_what_inductor_keeps(case):
    """The rehearsal's compiled-block saving (inductor's partitioner on fake tensors, nothing generated) equals
    the difference real inductor makes on CPU, and scales with the tokens of a micro-batch."""
    workers, train = COMPILED_CASES[case]
    trial = tiny_trial(workers, gpus=1, compile=True, seq_len=128, micro_batch=2, **train)
    eager, kept, _ = saved_by_real_inductor(trial)
    assert 0 < kept < eager
    saving = compiled.compiled_block_saving_gib(trial.config, trial.shape)
    assert saving * GIB == pytest.approx(eager - kept, rel=0.02)
    doubled = tiny_trial(workers, gpus=1, compile=True, seq_len=128, micro_batch=4, **train)
    assert compiled.compiled_block_saving_gib(doubled.config, doubled.shape) == pytest.approx(2 * saving, rel=0.05)


# An op-level policy for the tiny Llama block, spelled as the SAC ILP spells its policies.
TINY_POLICY = ["mm#0", "mm#2", "sdpa", "mul#2", "add#1"]


# tp runs with -m slow: the op policy's tags are counted the same under every strategy (fsdp2 here), and the
# compiled tp block against real inductor is test_compiled_blocks_keep_what_inductor_keeps[tp].
@pytest.mark.parametrize("case", ["fsdp2", pytest.param("tp", marks=pytest.mark.slow)])
def test_compiled_op_policy_blocks_keep_what_inductor_keeps(case):
    """A block checkpointed with an op-level policy and compiled keeps what inductor's partitioner keeps given
    the policy's tags: the rehearsal's saving equals the one real inductor makes on CPU. Eager, the policy's
    block keeps, beyond its input, what the whole trace holds per block over full AC: the block is counted in
    its strategy's arrangement (under tp: this rank's shards, autocast's casts, the input split over the
    sequence)."""
    workers, train = COMPILED_CASES[case]
    policy = {"seq_len": 128, "micro_batch": 2, "ac_ratio": "1", "ac_mode": "op", "ac_saved_ops": TINY_POLICY}
    trial = tiny_trial(workers, gpus=1, compile=True, **policy, **train)
    eager, kept, block_input = saved_by_real_inductor(trial, op_policy=True)
    saving = compiled.compiled_block_saving_gib(trial.config, trial.shape, op_policy=True)
    assert saving * GIB == pytest.approx(eager - kept, rel=0.02)
    assert saving != compiled.compiled_block_saving_gib(trial.config, trial.shape)  # the policy counts
    eager_trial = tiny_trial(workers, gpus=1, **policy, **train)
    full_ac = tiny_trial(workers, gpus=1, **{**policy, "ac_mode": "block", "ac_saved_ops": None}, **train)
    beyond_full_ac = (fake_trace(eager_trial).peak_gib - fake_trace(full_ac).peak_gib) * GIB
    assert eager - block_input == pytest.approx(beyond_full_ac / trial.shape.num_hidden_layers, rel=0.02)
    rehearsed = rehearsal.rehearse(trial.config, trial.shape, "H100 SXM")
    eager_rehearsed = rehearsal.rehearse(eager_trial.config, eager_trial.shape, "H100 SXM")
    assert rehearsed.memory_gib["activations"] == pytest.approx(
        eager_rehearsed.memory_gib["activations"] - trial.shape.num_hidden_layers * saving)
    assert traced_model.COMPILED_ACTIVATIONS_NOTE in rehearsed.notes


def test_a_compiled_fp8_block_keeps_what_a_bf16_block_keeps():
    """torchao's FP8 weight wraps the block's 16-bit one, and the compiled graph saves that inner tensor for
    backward: it is the weight (FSDP2 frees it after forward either way), not an activation. Under torchtitan's
    op-level policy an FP8 matmul's output is kept as a bf16 one's is, so the compiled blocks keep the same
    bytes but the FP8 scales (a few scalars)."""
    policy = {"seq_len": 128, "ac_ratio": "1", "ac_mode": "op", "compile": True}
    kept = {recipe: compiled._block_kept_bytes(trial.config, trial.shape, compiled=True, op_policy=True)
            for recipe, trial in ((r, tiny_trial(1, gpus=1, strategy="fsdp2", fp8=r, **policy))
                                  for r in ("off", "tensorwise"))}
    assert 0 <= kept["tensorwise"] - kept["off"] <= 64


@pytest.mark.parametrize("case", ["fsdp2", "tp"])
def test_compiled_trials_rehearse_with_fewer_activations(case):
    workers, train = COMPILED_CASES[case]
    eager_trial, compiled_trial = (tiny_trial(workers, gpus=1, compile=c, **train) for c in (False, True))
    eager = rehearsal.rehearse(eager_trial.config, eager_trial.shape, "H100 SXM")
    rehearsed = rehearsal.rehearse(compiled_trial.config, compiled_trial.shape, "H100 SXM")
    saving = compiled.compiled_block_saving_gib(compiled_trial.config, compiled_trial.shape)
    blocks = compiled_trial.shape.num_hidden_layers
    assert saving > 0
    assert rehearsed.memory_gib["activations"] == pytest.approx(eager.memory_gib["activations"] - blocks * saving)
    assert traced_model.COMPILED_ACTIVATIONS_NOTE in rehearsed.notes


def test_a_frozen_base_reserves_by_its_own_constant_and_stores_what_it_priced_with():
    """A LoRA trial's reserved peak is its tensors x the frozen base's reserve (fitted.py), a full fine-tune's x
    the full one's; the stored calibration is the one it priced with, so an op-level policy's limit agrees."""
    for finetune, reserve in (("lora", fitted.ALLOCATOR_RESERVE_FROZEN_BASE), ("full", fitted.ALLOCATOR_RESERVE)):
        trial = tiny_trial(2, gpus=1, strategy="fsdp2", finetune=finetune)
        found = rehearsal.rehearse(trial.config, trial.shape, "H100 SXM", analytic=trial.assessment.analytic)
        assert found.reserved_gib == pytest.approx(found.peak_gib * reserve)
        assert fitted.Calibration.of(found.as_dict()).reserve == reserve
    assert fitted.ALLOCATOR_RESERVE_FROZEN_BASE < fitted.ALLOCATOR_RESERVE


def test_cli_rehearses_and_estimate_uses_it(tmp_path, capsys):
    sweep = tmp_path / "s.yaml"
    sweep.write_text(json.dumps({
        "name": "r", "model": {"preset": "tiny"}, "train": {**TINY_TRAIN, "strategy": "fsdp2"},
        "resources": {"workers": 8, "gpus_per_worker": 1}, "estimate": {"gpu": "H100 SXM"},
        "store": str(tmp_path / "store"), "axes": {"setup": [
            {"train.strategy": "fsdp2"}, {"train.strategy": "deepspeed"},
            {"train.strategy": "deepspeed", "train.offload": "optimizer"}]}}))
    # In this process: the trials share no trace, so the default would start a worker process for each.
    assert main(["rehearse", str(sweep), "--json", "--jobs", "1"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["method"] for r in rows] == ["traced", "traced", "analytic"]
    assert "strategy deepspeed is not traced" in rows[2]["notes"][0]
    assert main(["estimate", str(sweep), "--json"]) == 0
    estimates = [json.loads(line)["estimate"] for line in capsys.readouterr().out.splitlines()]
    # The ZeRO trial's fit is decided on its rehearsal: DeepSpeed's states beside its FSDP2 twin's activations.
    assert [e["peak_basis"] for e in estimates] == ["rehearsed", "rehearsed", "analytic"]
    assert [e["rehearsed_step_time_s"] for e in estimates[:2]] == [r["step_time_s"] for r in rows[:2]]
    assert rows[1]["notes"][0] == rehearsal.ZERO_NOTE.format(stage=2)
    # The allocator's reserve on the tensor peak, plus the CUDA context the estimate assumes.
    for estimate, row in zip(estimates[:2], rows):
        assert estimate["rehearsed_peak_gib"] == pytest.approx(row["peak_gib"] * fitted.ALLOCATOR_RESERVE + 1.0)
    # Every figure carries its interval, the analytic fallback's the wider (planning/uncertainty.py).
    traced_step, analytic_step = (r["intervals"]["step_time_s"] for r in (rows[0], rows[2]))
    assert traced_step[0] < rows[0]["step_time_s"] < traced_step[1]
    assert analytic_step[1] / analytic_step[0] > traced_step[1] / traced_step[0]
    low, high = estimates[0]["peak_interval_gib"]
    assert low < estimates[0]["rehearsed_peak_gib"] < high
    assert main(["rehearse", str(sweep), "--trial", "nope"]) == 2
    assert "--trial" in capsys.readouterr().err


@pytest.mark.parametrize("stage", [2, 3])
def test_a_zero_trial_is_rehearsed_from_its_fsdp2_twin_with_deepspeeds_own_states(stage):
    """ZeRO's ranks run the operators and move the bytes of an FSDP2 twin that gathers once a step (stage 2) or
    again for backward (stage 3). Its memory: what DeepSpeed keeps for the step (its partitioning, the estimate's)
    beside the twin's traced activations and temporaries where they hold the most, reserved as the twin's
    allocator would; a step of two micro-batches says so. Offload runs the optimizer on the host: no twin."""
    zero = tiny_trial(4, gpus=1, strategy="deepspeed", zero_stage=stage, grad_accum=2)
    twin = tiny_trial(4, gpus=1, strategy="fsdp2", reshard_after_forward=stage == 3, reduce_dtype="bf16",
                      grad_accum=2)
    analytic = zero.assessment.analytic
    rehearsed = rehearsal.rehearse(zero.config, zero.shape, "H100 SXM", analytic=analytic)
    fsdp2 = rehearsal.rehearse(twin.config, twin.shape, "H100 SXM")
    assert rehearsed.method == "traced" and rehearsed.notes[0] == rehearsal.ZERO_NOTE.format(stage=stage)
    assert rehearsed.grad_accum == 2
    assert rehearsed.memory_gib == {
        "parameters": analytic.params_gib, "gradients": analytic.grads_gib, "optimizer_state": analytic.optimizer_gib,
        **fsdp2.working_gib}
    # The twin's activations and temporaries where they hold the most, which need not be at its own peak.
    assert sum(fsdp2.working_gib.values()) >= fsdp2.memory_gib["activations"] + fsdp2.memory_gib["temporaries"]
    assert rehearsed.peak_gib == pytest.approx(sum(rehearsed.memory_gib.values()))
    assert rehearsed.reserved_gib == pytest.approx(rehearsed.peak_gib * fitted.ALLOCATOR_RESERVE)
    # The twin gathers for each of the 2 micro-batches (twice for stage 3) and reduces once a step.
    gathers = fsdp2.comm_calls["allgather_base"]
    assert gathers == (2 if stage == 3 else 1) * 2 * fsdp2.comm_calls["reduce_scatter_base"]
    if stage == 3:  # DeepSpeed's ZeRO-3 gathers as the twin does
        assert rehearsed.step_time_s == fsdp2.step_time_s and rehearsed.comm_bytes == fsdp2.comm_bytes
    else:  # ZeRO-2 gathers the weights once a step, after the optimizer step: alone at the step's end
        assert rehearsed.comm_bytes == {**fsdp2.comm_bytes, "allgather_base": fsdp2.comm_bytes["allgather_base"] // 2}
        assert rehearsed.comm_calls["allgather_base"] == gathers // 2
        assert rehearsed.compute_s == fsdp2.compute_s
        gather_s = rehearsed.comm_bytes["allgather_base"] * nccl.bus_factor("allgather_base", 4) / (
            rehearsed.busbw_gbps * 1e9)
        assert rehearsed.exposed_comm_s >= gather_s > 0
    # DeepSpeed's bf16 reduces gradients in bf16: half the bytes of FSDP2's default fp32 reduction.
    fp32 = tiny_trial(4, gpus=1, strategy="fsdp2", reshard_after_forward=stage == 3, grad_accum=2)
    fp32_bytes = rehearsal.rehearse(fp32.config, fp32.shape, "H100 SXM").comm_bytes["reduce_scatter_base"]
    assert rehearsed.comm_bytes["reduce_scatter_base"] * 2 == fp32_bytes
    offloaded = tiny_trial(4, gpus=1, strategy="deepspeed", zero_stage=stage, offload="optimizer")
    host = rehearsal.rehearse(offloaded.config, offloaded.shape, "H100 SXM", analytic=offloaded.assessment.analytic)
    assert host.method == "analytic" and host.reserved_gib is None
    assert host.step_time_s == offloaded.assessment.analytic.step_time_s


def test_a_zero_trial_holds_its_twins_activations_where_they_hold_the_most():
    """The twin's peak can fall where its own states peak (a large model's optimizer step, activations gone);
    ZeRO's states differ, so its activations and temporaries are the twin's highest at any one place, less what
    compile keeps off the GPU there."""
    trace = dataclasses.replace(fake_trace(tiny_trial(2, gpus=1, strategy="fsdp2")), place_gib={
        "0:backward:outside": {"activations": 3.0, "temporaries": 0.5, "parameters": 1.0},
        "1:forward:outside": {"activations": 0.0, "temporaries": 1.0, "parameters": 9.0}})
    assert rehearsal._working_gib(trace, 0.0) == {"activations": 3.0, "temporaries": 0.5}
    assert rehearsal._working_gib(trace, 2.0) == {"activations": 1.0, "temporaries": 0.5}
    assert rehearsal._working_gib(trace, 2.8) == {"activations": 0.0, "temporaries": 1.0}


def test_a_set_bus_bandwidth_prices_the_collectives(tmp_path, capsys):
    """estimate.busbw_gbps, or --busbw over it, replaces the nominal links; a bad --busbw rehearses nothing."""
    def rehearsed(estimate: dict, *flags: str) -> dict:
        sweep = tmp_path / "s.yaml"
        sweep.write_text(json.dumps({
            "name": "r", "model": {"preset": "tiny"}, "train": {**TINY_TRAIN, "strategy": "fsdp2"},
            "resources": {"workers": 8, "gpus_per_worker": 1}, "estimate": {"gpu": "H100 SXM", **estimate},
            "store": str(tmp_path / "store")}))
        assert main(["rehearse", str(sweep), "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    links = rehearsed({})
    assert (links["busbw_gbps"], links["busbw_source"]) == (450.0, "links")
    slow = rehearsed({"busbw_gbps": 4.5})
    assert (slow["busbw_gbps"], slow["busbw_source"]) == (4.5, "set")
    def bytes_s(row: dict) -> float:  # the bandwidth part of the collectives' time; each call's latency apart
        return row["comm_s"] - row["comm_latency_s"]

    assert slow["comm_latency_s"] == links["comm_latency_s"] > 0
    four = rehearsed({"gpus_per_node": 4})  # 8 ranks on two 4-GPU nodes: the network's 4 x 50 GB/s
    assert (four["busbw_gbps"], four["layout"]) == (200.0, {"gpus_per_node": 4, "nics_per_node": 4})
    assert four["comm_latency_s"] > links["comm_latency_s"]
    assert bytes_s(slow) == pytest.approx(100 * bytes_s(links))
    assert bytes_s(rehearsed({"busbw_gbps": 4.5}, "--busbw", "45")) == pytest.approx(10 * bytes_s(links))
    shutil.rmtree(tmp_path / "store")
    assert main(["rehearse", str(tmp_path / "s.yaml"), "--busbw", "0"]) == 2
    assert "--busbw 0.0" in capsys.readouterr().err
    assert not (tmp_path / "store").exists()


def test_best_predict_picks_the_fastest_ratio_that_fits(tmp_path, capsys):
    """`raybench best SWEEP --predict` after `raybench rehearse SWEEP`: per micro-batch, the sAC ratio whose
    rehearsal fits with the highest predicted throughput; a device memory no ratio fits in says so."""
    def sweep(memory_gib: float):
        path = tmp_path / f"s{memory_gib}.yaml"
        path.write_text(json.dumps({
            "name": "r", "model": {"preset": "tiny"}, "train": {**TINY_TRAIN, "strategy": "fsdp2"},
            "resources": {"workers": 2, "gpus_per_worker": 1},
            "estimate": {"gpu": "H100 SXM", "device_memory_gib": memory_gib, "margin_gib": 0},
            "store": str(tmp_path / "store"), "axes": {"train.ac_ratio": ["0", "1"]}}))
        return str(path)

    assert main(["rehearse", sweep(80.0), "--json"]) == 0
    capsys.readouterr()
    (result,) = predicted_best(plan(load_sweep(sweep(80.0)), store_path=tmp_path / "store"))
    # Recomputing the checkpointed blocks costs time, so with room to spare the fastest ratio is 0.
    assert result["best"]["value"] == "0"
    assert [v["value"] for v in result["values"]] == ["0", "1"]
    assert result["op_policy"] is None  # not asked for (no stored rehearsals given)
    # The op-level policy starts from ratio 1's rehearsal; with room to spare it keeps every block's outputs.
    (result,) = predicted_best(plan(load_sweep(sweep(80.0)), store_path=tmp_path / "store"),
                               rehearsals=rehearsals.rehearsals(tmp_path / "store"))
    assert result["op_policy"]["policy"]["kept_fraction"] == 1.0
    assert main(["best", sweep(80.0), "--predict"]) == 0
    out = capsys.readouterr().out
    assert "best ac_ratio" in out
    assert "op-level policy" in out and "_scaled_dot_product_flash_attention_for_cpu" in out
    assert main(["best", sweep(1.0), "--predict"]) == 0  # 1 GiB: the CUDA context alone takes it
    out = capsys.readouterr().out
    assert out.count("none fits") == 2  # no ratio, and no op-level policy either
    assert main(["best", str(tmp_path), "--predict"]) == 2


def test_a_compiled_groups_op_policy_keeps_what_the_partitioner_keeps(tmp_path, capsys):
    """The ILP picks one policy for eager and compiled groups alike (the same full-AC trace); compiled, its peak
    is what inductor's partitioner keeps given that policy's tags, not what the eager policy keeps."""
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps({
        "name": "r", "model": {"preset": "tiny"}, "train": {**TINY_TRAIN, "strategy": "fsdp2", "seq_len": 128},
        "resources": {"workers": 1, "gpus_per_worker": 1}, "estimate": {"gpu": "H100 SXM"},
        "store": str(tmp_path / "store"), "axes": {"train.compile": [False, True], "train.ac_ratio": ["1"]}}))
    assert main(["rehearse", str(path), "--json"]) == 0
    capsys.readouterr()
    trials = plan(load_sweep(path), store_path=tmp_path / "store")
    eager, fused = (r["op_policy"]["policy"] for r in
                    predicted_best(trials, rehearsals=rehearsals.rehearsals(tmp_path / "store")))
    assert eager["ac_saved_ops"] == fused["ac_saved_ops"]
    config = trials[1].config.model_copy(update={"train": trials[1].config.train.model_copy(
        update={"ac_mode": "op", "ac_saved_ops": eager["ac_saved_ops"]})})
    saving = compiled.compiled_block_saving_gib(config, trials[1].shape, op_policy=True)
    assert saving > 0
    assert fused["peak_gib"] == pytest.approx(eager["peak_gib"] - trials[1].shape.num_hidden_layers * saving)


def test_a_trial_the_trace_cannot_run_falls_back_and_says_why(tmp_path):
    """A GPT-2 directory (blocks in `transformer.h`, not `*.layers`): FSDP2's per-block wrap refuses it; the
    rehearsal reports the analytic estimate with the error instead of stopping the sweep."""
    from safetensors.torch import save_file

    model_dir = tmp_path / "gpt2"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 256, "vocab_size": 500, "max_position_embeddings": 128}))
    save_file({"unused": torch.zeros(1)}, str(model_dir / "model.safetensors"))
    spec = parse_sweep({"name": "r", "model": {"path": str(model_dir)}, "train": {**TINY_TRAIN, "strategy": "fsdp2"},
                        "resources": {"workers": 2}})
    (trial,) = plan(spec)
    result = rehearsal.rehearse(trial.config, trial.shape, None, analytic=trial.assessment.analytic)
    assert result.method == "analytic"
    assert "trace failed (ValueError" in result.notes[0] and "layers" in result.notes[0]
    assert result.peak_gib == trial.assessment.analytic.measured_part_gib
    assert not dist.is_initialized()  # the fake world is gone, so the next trial can make its own


def test_sac_estimator_times_operators_with_the_hardware_tables_roofline():
    """Pins the SAC estimator hook: torch's SACEstimator takes each operator's time from the instance's
    `_estimate_runtime`, here raybench's roofline for an H100 SXM (no CUDA needed), in milliseconds."""
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator
    from torch.distributed._tools.sac_estimator import SACEstimator

    from raybench.spec.hardware import memory_bandwidth_tb_per_s, peak_tflops

    assert SACEstimator()._estimate_runtime == RuntimeEstimator._roofline_estimate  # what the hook replaces
    tokens, d_in, d_out = 4096, 2048, 8192
    with fake_world.fake_mode():
        block = torch.nn.Sequential(torch.nn.Linear(d_in, d_out, bias=False, dtype=torch.bfloat16), torch.nn.SiLU())
        x = torch.empty(tokens, d_in, dtype=torch.bfloat16, requires_grad=True)
        estimator = policy._sac_estimator(roofline.gpu_roofline("H100 SXM"))
        with estimator:
            block(x)
    stats = estimator.sac_mod_stats["Sequential"]
    runtime = dict(zip(stats.func_names, stats.runtimes))
    # The matmul is compute-bound: 2 x M x N x K FLOPs at the bf16 dense peak; SiLU reads and writes its tensor.
    assert runtime["mm"] == pytest.approx(2 * tokens * d_in * d_out / (peak_tflops("H100 SXM", "bf16") * 1e12) * 1e3)
    assert runtime["silu"] == pytest.approx(2 * tokens * d_out * 2 / (memory_bandwidth_tb_per_s("H100 SXM") * 1e12)
                                            * 1e3)


@pytest.fixture(scope="module")
def full_ac() -> tuple[dict, int, dict]:
    """The tiny preset's FSDP2 GPU rehearsal with every block checkpointed (with one block's operators), its
    layer count, and the same trial's rehearsal without checkpointing."""
    trials = {ratio: tiny_trial(2, gpus=1, strategy="fsdp2", ac_ratio=ratio) for ratio in ("0", "1")}
    got = {ratio: rehearsal.rehearse(t.config, t.shape, "H100 SXM").as_dict() for ratio, t in trials.items()}
    assert got["0"]["block_ops"] is None and got["1"]["block_ops"]  # only full AC is a policy's starting point
    return got["1"], trials["1"].shape.num_hidden_layers, got["0"]


def test_op_policy_fits_the_limit_and_a_tighter_limit_recomputes_more(full_ac):
    full, layers, no_ac = full_ac
    full_ac_reserved = full["peak_gib"] * fitted.ALLOCATOR_RESERVE
    block_gib = sum(policy._recomputable(full["block_ops"]).memory) / 2**30
    policies = []
    for share in (0.2, 0.6):  # of the room every block's outputs would take on top of full AC
        limit = full_ac_reserved + share * layers * block_gib * fitted.ALLOCATOR_RESERVE
        chosen = policy.op_policy(full, layers, limit)
        assert chosen.reserved_gib <= limit
        assert 0 < chosen.kept_fraction < 1
        policies.append(chosen)
    tight, loose = policies
    assert sum(tight.recomputed.values()) > sum(loose.recomputed.values())
    assert tight.saved_gib_per_block < loose.saved_gib_per_block
    # Recomputing more costs time: between no checkpointing and full AC.
    # Recomputation is compute (the tiny model's step itself is its collectives' latency)
    assert no_ac["compute_s"] <= loose.compute_s < tight.compute_s <= full["compute_s"]
    assert policy.op_policy(full, layers, 0.9 * full_ac_reserved) is None  # not even full AC fits


def test_op_policy_with_room_for_everything_is_the_step_without_checkpointing(full_ac):
    """Saving every operator a block's backward needs (plus what it may keep for free) predicts what the
    trace of the same trial without checkpointing measures: the memory and time models close the loop."""
    full, layers, no_ac = full_ac
    chosen = policy.op_policy(full, layers, 100.0)
    assert chosen.kept_fraction == 1.0 and sum(chosen.recomputed.values()) <= 2  # only free scalar ops, if any
    assert chosen.step_time_s == pytest.approx(no_ac["step_time_s"], rel=0.02)
    ops = policy._recomputable(full["block_ops"])
    autograd_gib = sum(ops.memory[i] for i in ops.saved_autograd_ops) / 2**30
    assert full["peak_gib"] + layers * autograd_gib == pytest.approx(no_ac["peak_gib"], rel=0.02)


def test_the_op_level_policy_runs_and_keeps_what_the_ilp_predicted(tmp_path):
    """The ILP's policy, run as train.ac_saved_ops (ac_mode op): its tensor peak traced on fake tensors and
    measured for real on a gloo rank equals the peak op_policy predicted from the full-AC rehearsal."""
    base = tiny_trial(1, gpus=1, strategy="fsdp2", ac_ratio="1", seq_len=256)
    full = rehearsal.rehearse(base.config, base.shape, "H100 SXM").as_dict()
    layers = base.shape.num_hidden_layers
    block_gib = sum(policy._recomputable(full["block_ops"]).memory) / 2**30
    limit = (full["peak_gib"] + 0.3 * layers * block_gib) * fitted.ALLOCATOR_RESERVE
    chosen = policy.op_policy(full, layers, limit)
    assert 0 < chosen.kept_fraction < 1 and any("#" in op for op in chosen.ac_saved_ops)
    trial = tiny_trial(1, gpus=1, strategy="fsdp2", ac_ratio="1", seq_len=256, ac_mode="op",
                       ac_saved_ops=chosen.ac_saved_ops)
    assert fake_trace(trial).peak_gib == pytest.approx(chosen.peak_gib, rel=0.01)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        real = real_trace(trial, RankContext(0, 1, 0, torch.device("cpu")))
    finally:
        dist.destroy_process_group()
    assert real.peak_gib == pytest.approx(chosen.peak_gib, rel=0.01)
    assert chosen.peak_gib > full["peak_gib"]  # it keeps more than full AC, within the limit
