"""The step profile: a few steps of a tiny model under torch.profiler, reduced to seconds per category."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent
from torch.nn.attention import SDPBackend, sdpa_kernel

from raybench.runtime import rank_metrics, step_profile
from raybench.spec.errors import ConfigError
from raybench.spec.load import parse_sweep
from raybench.spec.sweep_spec import TrainSpec, TrialConfig

CPU = torch.device("cpu")
CATEGORIES = ("profile_matmul_s", "profile_attention_s", "profile_elementwise_s", "profile_optimizer_s",
              "profile_comm_s", "profile_idle_s")


def tiny_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=96, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, device=CPU):
    ids = torch.randint(0, 96, (2, 32), device=device)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
    return step


def test_a_training_step_splits_into_categories_that_add_up_to_its_wall_time():
    model = tiny_model()
    step = training_step(model, torch.optim.AdamW(model.parameters(), foreach=True))
    step()  # the optimizer's state exists before the profiled steps, as after a trial's timed ones
    found = step_profile.profile_steps(step, 2, CPU)
    assert set(found) == set(step_profile.COLUMNS)
    assert all(found[c] >= 0 for c in CATEGORIES), found
    # The model's projections and its SDPA attention ran; so did the optimizer; nothing communicated.
    assert found["profile_matmul_s"] > 0 and found["profile_attention_s"] > 0
    assert found["profile_elementwise_s"] > 0 and found["profile_optimizer_s"] > 0
    assert found["profile_comm_s"] == 0
    # On CPU one thread runs the step and its ops' self times never overlap: the categories and idle are the
    # step's wall time, exactly (up to rounding).
    assert math.isclose(sum(found[c] for c in CATEGORIES), found["profile_step_s"], rel_tol=1e-9)


def test_without_an_optimizer_step_the_optimizer_share_is_zero():
    model = tiny_model()
    found = step_profile.profile_steps(training_step(model, None), 1, CPU)
    assert found["profile_optimizer_s"] == 0
    assert found["profile_matmul_s"] > 0 and found["profile_attention_s"] > 0


def test_a_matmul_inside_attention_counts_as_attention():
    """SDPA's math backend computes attention's forward with bmm inside its own op: the enclosing attention op
    takes them. (Its backward runs as autograd's bmm nodes, outside any attention op: matmul there.)"""
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))

    def attention_only() -> None:
        with sdpa_kernel(SDPBackend.MATH):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    found = step_profile.profile_steps(attention_only, 2, CPU)
    assert found["profile_attention_s"] > 0
    assert found["profile_matmul_s"] == 0


def test_a_collective_counts_as_communication():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        grads = torch.ones(1024)
        found = step_profile.profile_steps(lambda: dist.all_reduce(grads), 3, CPU)
    finally:
        dist.destroy_process_group()
    assert found["profile_comm_s"] > 0
    assert found["profile_matmul_s"] == found["profile_attention_s"] == found["profile_optimizer_s"] == 0


@pytest.mark.parametrize("name, expected", [
    ("aten::linear", "matmul"), ("aten::addmm", "matmul"),
    ("autograd::engine::evaluate_function: MmBackward0", "matmul"), ("AddmmBackward0", "matmul"),
    ("aten::_scaled_mm", "matmul"), ("triton_tem_fused_mm_0", "matmul"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT", "matmul"), ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "matmul"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>", "matmul"),
    ("aten::scaled_dot_product_attention", "attention"), ("aten::_efficient_attention_backward", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention"),
    ("cutlass::device_kernel<flash::enable_sm90<flash::FlashAttnFwdSm90>>", "attention"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "comm"), ("_c10d_functional::all_gather_into_tensor", "comm"),
    ("c10d::allreduce_", "comm"), ("record_param_comms", "comm"), ("Optimizer.step#AdamW.step", "optimizer"),
    ("aten::layer_norm", "elementwise"), ("triton_poi_fused_add_mul_0", "elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise"),
])
def test_names_fall_into_their_category(name, expected):
    assert step_profile.category(name) == expected


def _event(id_: int, name: str, start_us: float, end_us: float, parent: FunctionEvent | None = None,
           **kwargs) -> FunctionEvent:
    event = FunctionEvent(id=id_, name=name, thread=1, start_us=start_us, end_us=end_us, **kwargs)
    if parent is not None:
        event.set_cpu_parent(parent)
        parent.append_cpu_child(event)
    return event


def _kernel(name: str, start_us: float, end_us: float, launched_by: int = 0,
            activity_type: str = "kernel") -> FunctionEvent:
    return _event(100 + int(start_us), name, start_us, end_us, device_type=DeviceType.CUDA,
                  activity_type=activity_type, linked_correlation_id=launched_by)


def test_device_time_is_kernel_time_and_idle_is_what_no_kernel_covers():
    """The CUDA reduction on the events the profiler lays out there (no GPU needed): kernels take the category
    of their name or of the op that launched them; overlapping kernels each count, idle is the step's wall time
    minus their union; the GPU's copies of the CPU's ranges (annotations) are not work."""
    mark = _event(1, step_profile.STEP_RANGE, 0, 100, is_user_annotation=True, activity_type="user_annotation")
    mm = _event(2, "aten::mm", 10, 20, mark, activity_type="cpu_op")
    optimizer = _event(3, "Optimizer.step#AdamW.step", 80, 95, mark, is_user_annotation=True,
                       activity_type="user_annotation")
    foreach = _event(4, "aten::_foreach_add_", 82, 88, optimizer, activity_type="cpu_op")
    events = [mark, mm, optimizer, foreach,
              _event(90, step_profile.STEP_RANGE, 0, 100, device_type=DeviceType.CUDA,
                     activity_type="gpu_user_annotation"),
              _kernel("void gemm_kernel<float>", 30, 60, launched_by=2),  # matmul: by its op and its name
              _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 40, 80),  # comm, on its own stream
              _kernel("void multi_tensor_apply_kernel<AddFunctor>", 90, 98, launched_by=4),  # inside the optimizer
              _kernel("Memset (Device)", 98, 99, activity_type="gpu_memset")]  # elementwise
    found = step_profile.breakdown(events, 1, cuda=True)
    assert found == pytest.approx({"profile_comm_s": 40e-6, "profile_optimizer_s": 8e-6, "profile_attention_s": 0,
                                   "profile_matmul_s": 30e-6, "profile_elementwise_s": 1e-6,
                                   # busy: [30, 80) and [90, 99): 59 of the step's 100 us
                                   "profile_idle_s": 41e-6, "profile_step_s": 100e-6})
    # The 20 us the gemm and the all-reduce overlap count in both: the sum exceeds the wall time by them.
    assert sum(found[c] for c in CATEGORIES) == pytest.approx(found["profile_step_s"] + 20e-6)


class _RawEvent:
    """The profiler's raw record of an event (the methods torch 2.11 reads its FunctionEvents from)."""

    def __init__(self, event: FunctionEvent, linked: int, trace_start_ns: int):
        self.event, self.linked, self.trace_start_ns = event, linked, trace_start_ns

    def correlation_id(self): return self.event.id
    def device_type(self): return self.event.device_type
    def start_ns(self): return int(self.event.time_range.start * 1000) + self.trace_start_ns
    def end_ns(self): return int(self.event.time_range.end * 1000) + self.trace_start_ns
    def linked_correlation_id(self): return self.linked


class _RawResults:
    def __init__(self, raw: list[_RawEvent], trace_start_ns: int):
        self.raw, self.start = raw, trace_start_ns

    def events(self): return self.raw
    def trace_start_ns(self): return self.start


def test_on_torch_2_11_kernels_are_linked_to_their_ops_through_the_raw_events():
    """torch 2.11's FunctionEvent has no linked_correlation_id and no activity_type: the links come from the raw
    events each was built from, and every device event but the device's copy of a range is work. The step
    then splits as on a newer torch."""
    def trace():
        mark = _event(1, step_profile.STEP_RANGE, 0, 100, is_user_annotation=True)
        mm = _event(2, "aten::mm", 10, 20, mark)
        return [mark, mm,
                _event(2, step_profile.STEP_RANGE, 0, 100, device_type=DeviceType.CUDA, is_user_annotation=True,
                       activity_type="gpu_user_annotation"),
                _kernel("triton_per_fused_0", 30, 60, launched_by=2),  # by its op: matmul
                _kernel("Memset (Device)", 98, 99, activity_type="gpu_memset")]

    newer = step_profile.breakdown(trace(), 1, cuda=True)
    older, start_ns = trace(), 5_000_000_000
    results = _RawResults([_RawEvent(e, e.linked_correlation_id, start_ns) for e in older], start_ns)
    for event in older:
        del event.linked_correlation_id, event.activity_type
    step_profile._link_device_events(results, older)
    assert step_profile.breakdown(older, 1, cuda=True) == newer
    assert newer["profile_matmul_s"] == pytest.approx(30e-6) and newer["profile_elementwise_s"] == pytest.approx(1e-6)


def test_the_row_carries_the_profile_and_nulls_without_one():
    assert set(step_profile.COLUMNS) == set(rank_metrics.PROFILE_COLUMNS)
    record = {"step_times_s": [1.0, 1.0], "step_starts_wall": [0.0, 1.0], "tokens": [8, 8], "nonpad_tokens": [8, 8],
              "losses": [2.0, 1.0], "peaks": {"rss_gib": 1.0, "alloc_gib": None, "reserved_gib": None}}
    reduced = rank_metrics.combine([record], tp_size=1, warmup_steps=1)

    def row(profile: dict):
        return rank_metrics.trial_metrics(reduced, rank_metrics.TrialFacts(
            train=TrainSpec(steps=2, warmup_steps=1), world_size=1, dp_size=1, params_total=1, params_trainable=1,
            flops_per_token=None, peak_tflops=None, comm_exposed_p50_s=None, weights_cache=None,
            weights_copy_s=None, worker_wall_s=2.0, process_trial_index=0, profile=profile))

    assert all(getattr(row({}), column) is None for column in step_profile.COLUMNS)
    given = {column: 0.001 * (i + 1) for i, column in enumerate(step_profile.COLUMNS)}
    profiled = row(given)
    assert {column: getattr(profiled, column) for column in step_profile.COLUMNS} == given


def test_profile_steps_is_off_by_default_and_keeps_trial_ids():
    base = {"model": {"preset": "tiny"}}
    off = TrialConfig.model_validate(base)
    assert off.train.profile_steps == 0
    assert "profile_steps" not in off.model_dump(mode="json")["train"]
    on = TrialConfig.model_validate({**base, "train": {"profile_steps": 3}})
    assert on.model_dump(mode="json")["train"]["profile_steps"] == 3
    assert step_profile.profile_training(None, iter(()), TrainSpec(), CPU) == {}


@pytest.mark.parametrize("bad", [-1, 21])
def test_bad_profile_steps_are_refused_naming_the_field(bad):
    with pytest.raises(ConfigError) as refused:
        parse_sweep({"name": "p", "model": {"preset": "tiny"}, "train": {"profile_steps": bad}})
    assert "train.profile_steps" in str(refused.value)


def test_a_users_stack_refuses_profile_steps():
    from raybench.planning import stacks

    config = TrialConfig.model_validate({"model": {"preset": "tiny"}, "train": {"profile_steps": 2},
                                         "stack": {"kind": "command", "command": ["{python}", "train.py"]}})
    assert any(p.field == "train.profile_steps" for p in stacks.problems(config))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_categories_are_device_time():
    device = torch.device("cuda")
    model = tiny_model().to(device)
    step = training_step(model, torch.optim.AdamW(model.parameters(), fused=True), device)
    step()
    found = step_profile.profile_steps(step, 2, device)
    assert all(found[c] >= 0 for c in CATEGORIES), found
    assert found["profile_matmul_s"] > 0 and found["profile_attention_s"] > 0 and found["profile_optimizer_s"] > 0
    # One stream, no collective: no kernels overlap, so the categories and idle add up to the wall time.
    assert sum(found[c] for c in CATEGORIES) == pytest.approx(found["profile_step_s"], rel=1e-6)
