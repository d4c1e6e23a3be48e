"""The memory/step-time estimate: hand-computed values for known configurations, the activation count checked
against the tensors torch really saves, pruning in plan, calibration from stored rows, the error column."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from datetime import datetime, timezone
from fractions import Fraction

import pytest

from raybench.cli import main as cli
from raybench.drivers.api import run_sweep
from raybench.drivers.trial import build_row
from raybench.planning import calibration, estimate
from raybench.planning.assessment import Assessment
from raybench.planning.plan import plan
from raybench.reports import tables
from raybench.results import store
from raybench.spec.load import parse_sweep
from raybench.spec.payload import AssessmentData, TrialPayload
from raybench.spec.presets import PRESETS, ModelShape
from raybench.spec.sac import checkpointed_blocks
from raybench.spec.schema import RankResult
from raybench.spec.sweep_spec import LoraSpec, TrainSpec, TrialConfig

GIB = 2**30
# Llama-3-8B by hand: hidden 4096, 32 layers, 32 heads of 128, 8 KV heads (1024), MLP 14336, vocab 128256.
H, L, KV, INTER, V, HEADS = 4096, 32, 1024, 14336, 128256, 32
BLOCK = 2 * H * H + 2 * H * KV + 3 * H * INTER  # q, o + k, v + gate, up, down: 218,103,808
PROJ = L * BLOCK
VH = V * H
N = PROJ + L * 2 * H + 2 * VH + H  # + norms, embedding, head, final norm
ROOT = 2 * VH + H  # FSDP2's root unit: embedding, head, final norm
BLOCK_UNIT = BLOCK + 2 * H  # one decoder block as FSDP2 shards it (projections + its two norms)
# What ZeRO-3 holds whole as backward begins: the head (reused at once), then backward's next weights while under
# DeepSpeed's live limit of 1e9 elements (the last two blocks' projections), and the norms (never partitioned).
ZERO3_GATHERED = VH + 2 * BLOCK + (2 * L + 1) * H
LORA16 = L * 16 * ((H + H) + 2 * (H + KV) + (H + H) + 2 * (H + INTER) + (INTER + H))  # r=16 on all 7


def trial(strategy: str = "ddp", workers: int = 8, gpus: int = 1, preset: str = "llama-3-8b", **train) -> TrialConfig:
    # The full loss: the figures written out by hand below count its logits (test_chunked_loss_* the chunked one).
    train = {"seq_len": 2048, "micro_batch": 1, "precision": "bf16", "loss": "full", **train}
    return TrialConfig.model_validate({"model": {"preset": preset}, "train": {"strategy": strategy, **train},
                                       "resources": {"workers": workers, "gpus_per_worker": gpus}})


def est(config: TrialConfig, ac_blocks=(), gpu: str | None = None) -> estimate.Estimate:
    return estimate.estimate(config, PRESETS[config.model.preset], list(ac_blocks), gpu)


def test_parameter_counts_match_published_sizes():
    shape = PRESETS["llama-3-8b"]
    assert N == 8_030_261_248
    assert estimate.param_counts(shape, TrainSpec()).total == N
    lora = estimate.param_counts(shape, TrainSpec(finetune="lora", lora=LoraSpec(rank=16)))
    assert lora.adapters == LORA16 == 41_943_040  # the usual "41.9M trainable" of Llama-3-8B LoRA r16 all-linear
    attention = estimate.param_counts(shape, TrainSpec(finetune="lora", lora=LoraSpec(rank=16, targets="attention")))
    assert attention.adapters == L * 16 * (2 * (H + H) + 2 * (H + KV))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_parameter_counts_match_a_real_model(model_type):
    from transformers import AutoConfig, AutoModelForCausalLM

    from raybench.runtime.model import count_params
    from raybench.runtime.techniques import lora

    shape = ModelShape(model_type, 64, 2, 4, 2, 96, 300, 512, model_type == "qwen2")  # qwen2: biases, tied head
    hf = AutoConfig.for_model(model_type, **shape.hf_config_kwargs())
    model = AutoModelForCausalLM.from_config(hf)
    assert count_params(model)[0] == estimate.param_counts(shape, TrainSpec()).total
    spec = TrainSpec(finetune="lora", lora=LoraSpec(rank=4, targets="all_linear"))
    total, trainable = count_params(lora.apply(model, spec))
    counts = estimate.param_counts(shape, spec)
    assert (total, trainable) == (counts.total, counts.adapters)


def test_ddp_full_finetune_bf16_on_8_gpus():
    e = est(trial("ddp"))
    # fp32 weights, plus autocast's bf16 copy of every matmul weight (projections and the head)
    assert e.params_gib == pytest.approx((4 * N + 2 * (PROJ + VH)) / GIB)
    assert e.grads_gib == pytest.approx((4 * N + 4 * N) / GIB)  # .grad plus DDP's bucket copy
    assert e.optimizer_gib == pytest.approx(8 * N / GIB)  # AdamW: two fp32 moments
    assert e.other_gib == estimate.CUDA_OVERHEAD_GIB and e.device == "cuda"
    assert e.peak_gib == pytest.approx(e.params_gib + e.grads_gib + e.optimizer_gib + e.activations_gib + 1.0)
    assert e.measured_part_gib == pytest.approx(e.peak_gib - 1.0)  # the allocator does not see the context


def test_fsdp2_shards_everything_over_8_gpus():
    e = est(trial("fsdp2"))
    # fp32 shard of everything, plus bf16 unsharded copies of the root and of two blocks (current + prefetched)
    assert e.params_gib == pytest.approx((4 * N / 8 + 2 * (ROOT + 2 * BLOCK_UNIT)) / GIB)
    assert e.grads_gib == pytest.approx((4 * N / 8 + BLOCK_UNIT * (2 + 4)) / GIB)  # + one block before reduce
    assert e.optimizer_gib == pytest.approx(8 * N / 8 / GIB)
    kept = est(trial("fsdp2", reshard_after_forward=False))
    assert kept.params_gib == pytest.approx((4 * N / 8 + 2 * N) / GIB)  # every block stays gathered


def test_deepspeed_zero_stages_on_8_gpus():
    bucket = estimate.ZERO_BUCKET_ELEMENTS * 2  # bf16 reduce bucket
    zero2 = est(trial("deepspeed", zero_stage=2))
    assert zero2.params_gib == pytest.approx(2 * N / GIB)  # the engine casts the module to bf16
    assert zero2.grads_gib == pytest.approx((2 * N / 8 + 2 * bucket) / GIB)  # overlap_comm: two buckets
    assert zero2.optimizer_gib == pytest.approx((4 * N + 8 * N) / 8 / GIB)  # fp32 master + moments, sharded
    zero1 = est(trial("deepspeed", zero_stage=1))
    assert zero1.grads_gib == pytest.approx((2 * N + 2 * bucket) / GIB)
    zero3 = est(trial("deepspeed", zero_stage=3))
    assert zero3.params_gib == pytest.approx((2 * N / 8 + 2 * ZERO3_GATHERED) / GIB)
    assert zero3.grads_gib == pytest.approx((2 * N / 8 + bucket) / GIB)
    offload = est(trial("deepspeed", zero_stage=3, offload="optimizer_params"))
    assert offload.optimizer_gib == 0
    assert offload.offloaded_gib == pytest.approx((12 * N / 8 + 2 * N / 8) / GIB)
    assert offload.params_gib == pytest.approx(2 * ZERO3_GATHERED / GIB)
    assert zero1.peak_gib > zero2.peak_gib > zero3.peak_gib > offload.peak_gib


def test_lora_r16_trains_only_adapters():
    e = est(trial("ddp", finetune="lora", lora={"rank": 16}))
    assert e.params_trainable == LORA16
    # the frozen base in bf16 (auto under bf16 compute), fp32 adapters; autocast casts the adapters only
    assert e.params_gib == pytest.approx((2 * N + 4 * LORA16 + 2 * LORA16) / GIB)
    fp32_base = est(trial("ddp", finetune="lora", lora={"rank": 16, "base_dtype": "fp32"}))
    assert fp32_base.params_gib == pytest.approx((4 * (N + LORA16) + 2 * (PROJ + VH + LORA16)) / GIB)
    assert e.grads_gib == pytest.approx(8 * LORA16 / GIB)
    assert e.optimizer_gib == pytest.approx(8 * LORA16 / GIB)
    qlora = est(trial("ddp", finetune="qlora", lora={"rank": 16}))
    # 4-bit projections; fp32 embeddings, norms and adapters; autocast casts only the head and adapters
    assert qlora.params_gib == pytest.approx((estimate.NF4_BYTES_PER_PARAM * PROJ + 4 * (N - PROJ + LORA16)
                                              + 2 * (VH + LORA16)) / GIB)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_bf16_lora_base_halves_the_base_weights(strategy):
    """The frozen base's stored bytes halve (fp32 -> bf16); ddp also drops autocast's bf16 copies of the base,
    which a bf16 base does not need. Adapters, gradients and optimizer state stay as they were."""
    def lora(base_dtype: str) -> estimate.Estimate:
        return est(trial(strategy, workers=1, finetune="lora", lora={"rank": 16, "targets": "all_linear",
                                                                     "base_dtype": base_dtype}))

    bf16, fp32 = lora("auto"), lora("fp32")
    saved = 2 * N + (2 * (PROJ + VH) if strategy == "ddp" else 0)  # two bytes per base weight, + the casts
    assert fp32.params_gib - bf16.params_gib == pytest.approx(saved / GIB)
    assert lora("bf16").params_gib == bf16.params_gib
    for part in ("grads_gib", "optimizer_gib"):
        assert getattr(bf16, part) == getattr(fp32, part)
    assert est(trial("deepspeed", workers=1, finetune="lora")).params_gib == pytest.approx(2 * (N + LORA16) / GIB)


def test_tensor_parallel_splits_the_projections_the_vocabulary_and_the_sequence():
    e = est(trial("tp", workers=8, tp_size=8, precision="fp32"))
    local = (PROJ + 2 * VH) / 8 + (N - PROJ - 2 * VH)  # projections, embedding and head split; norms whole
    assert e.params_gib == pytest.approx(4 * local / GIB)
    assert e.grads_gib == pytest.approx(4 * local / GIB) and e.optimizer_gib == pytest.approx(8 * local / GIB)
    # Under Liger (its fused head and loss kernel takes the whole head) the embedding and head stay whole.
    liger = est(trial("tp", workers=8, tp_size=8, precision="fp32", liger=True))
    assert liger.params_gib == pytest.approx(4 * (PROJ / 8 + (N - PROJ)) / GIB)
    # Sequence parallelism: each rank keeps 1/8 of what the norms keep and computes the loss on 1/8 of the logits;
    # with a tied head (the projections split, nothing else) all of it.
    shape, train = PRESETS["llama-3-8b"], trial("tp", workers=8, tp_size=8).train
    tied = dataclasses.replace(shape, tie_word_embeddings=True)
    per_token = {s.tie_word_embeddings: estimate.activation_bytes_per_token(s, train, []) for s in (shape, tied)}
    norms, _, _ = estimate.block_activation_bytes(shape, train)
    final_norm = 4 * H + 4 * H  # fp32 input and normalized output (autocast keeps the residual stream fp32)
    whole = L * norms + final_norm + V * estimate.LOSS_BYTES_PER_VOCAB_ENTRY
    assert per_token[True] - per_token[False] == pytest.approx(whole * 7 / 8)


def test_optimizer_states():
    adamw, sgd = est(trial("ddp")), est(trial("ddp", optimizer="sgd"))
    assert sgd.optimizer_gib == pytest.approx(adamw.optimizer_gib / 2)  # one momentum buffer
    factored = est(trial("ddp", optimizer="adafactor"))
    rows_cols = L * ((H + H) * 2 + (H + KV) * 2 + (H + INTER) * 3) + 2 * (V + H) + L * 2 * H + H
    assert factored.optimizer_gib == pytest.approx(4 * rows_cols / GIB)  # a row and a column per matrix
    flat = est(trial("deepspeed", optimizer="adafactor"))  # DeepSpeed hands it flat 1-D partitions
    assert flat.optimizer_gib == pytest.approx((4 * N + 4 * N) / 8 / GIB)


def _activations_per_token(checkpointed: int) -> float:
    """Llama-3-8B, DDP bf16 autocast, full fine-tuning, written out tensor by tensor."""
    attn_norm = 4 * H + 4 * H + 3 * 2 * H  # fp32 input, fp32 normalized, bf16 input casts of q, k, v
    mlp_norm = 4 * H + 4 * H + 2 * 2 * H  # ... of gate and up
    attention = 2 * (H + KV + KV + H) + 4 * HEADS  # bf16 q, k, v, output; fp32 logsumexp per head
    mlp = 2 * 4 * INTER  # gate out, silu out, up out, product
    block = attn_norm + mlp_norm + attention + mlp
    head = 4 * H + 4 * H + 2 * H + 12 * V  # final norm, head input cast, logits and loss
    recompute = block if checkpointed else 0
    return (L - checkpointed) * block + checkpointed * 4 * H + recompute + head


def test_chunked_loss_keeps_the_head_inputs_gradient_and_one_chunk_instead_of_the_logits():
    """DDP bf16 autocast: the head's input and its bf16 cast and the logits' 12 bytes per entry go; the fp32
    gradient of the head's input (made in forward) and one chunk's logits (1024 of the 2048 tokens) come."""
    full, chunked = est(trial("ddp")), est(trial("ddp", loss="chunked"))
    head_full = 2 * H + 12 * V
    head_chunked = 4 * H + 12 * V * 1024 / 2048
    assert full.activations_gib - chunked.activations_gib == pytest.approx(2048 * (head_full - head_chunked) / GIB)
    # Where the trial falls back to the full loss (a vocabulary-split head under TP), nothing changes.
    assert est(trial("tp", tp_size=8, loss="chunked")).activations_gib == est(trial("tp", tp_size=8)).activations_gib


def test_activations_by_hand_and_ac_ratio_keeps_checkpointed_blocks_input_only():
    assert est(trial("ddp")).activations_gib == pytest.approx(2048 * _activations_per_token(0) / GIB)
    for ratio, blocks in (("1/2", 16), ("1", 32)):
        ac = checkpointed_blocks(Fraction(ratio), L)
        assert len(ac) == blocks
        assert est(trial("ddp", ac_ratio=ratio), ac).activations_gib == pytest.approx(
            2048 * _activations_per_token(blocks) / GIB)
    half, full = (est(trial("ddp", micro_batch=4), range(n)).activations_gib for n in (16, 32))
    assert full < half < est(trial("ddp", micro_batch=4)).activations_gib


def test_liger_keeps_no_logits_and_less_per_block():
    # FSDP2 bf16 full fine-tune (16-bit residual stream), per token. Liger's RMSNorm keeps its 16-bit input and
    # a 4-byte rstd instead of the fp32 input plus the normalized copy (2 per block, and the final norm); its
    # SwiGLU keeps gate's and up's outputs, not silu's; its fused linear cross-entropy keeps no logits and no
    # head input, only the 16-bit gradient of the head's input (measured on an H100: docs/estimate.md).
    per_block = 2 * ((4 * H + 2 * H) - (2 * H + 4)) + INTER * 2
    head = (4 * H + 2 * H) + 2 * H + V * estimate.LOSS_BYTES_PER_VOCAB_ENTRY - (2 * H + 4 + 2 * H)
    saved = est(trial("fsdp2")).activations_gib - est(trial("fsdp2", liger=True)).activations_gib
    assert saved == pytest.approx(2048 * (L * per_block + head) / GIB)


def _saved_bytes_per_token(model, batch: int, seq: int, autocast: bool) -> float:
    """Bytes autograd saves inside decoder block 1 (a steady-state block), per token, counted once per storage.

    Weight casts and rotary tables are not activations: only tensors with a batch or token leading dimension
    count (batch x seq is chosen to differ from every weight dimension).
    """
    import torch

    from raybench.runtime.model import decoder_blocks

    inside = [False]
    block = decoder_blocks(model)[1]
    block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    block.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    saved: dict[int, int] = {}

    def pack(t):
        if inside[0] and t.dim() and t.shape[0] in (batch, batch * seq):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 1000, (batch, seq))
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
        model(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    return sum(saved.values()) / (batch * seq)


@pytest.mark.parametrize("strategy, precision, finetune, targets", [
    ("ddp", "fp32", "full", "attention"),
    ("ddp", "bf16", "full", "attention"),  # autocast over fp32 weights
    ("fsdp2", "bf16", "full", "attention"),  # bf16 weights (FSDP2's policy, DeepSpeed's cast)
    ("ddp", "fp32", "lora", "attention_mlp"),
    ("ddp", "bf16", "lora", "attention"),  # a bf16 base under autocast
    ("ddp", "bf16", "lora-fp32-base", "attention_mlp"),
    # Dropout recomputed in backward (techniques/lora.py): the adapters keep no dropped copies, no masks.
    ("fsdp2", "bf16", "lora-dropout", "all_linear"),
    ("ddp", "bf16", "lora-dropout", "all_linear"),
    ("ddp", "fp32", "lora-dropout", "attention_mlp"),
])
def test_block_activations_match_what_torch_saves(strategy, precision, finetune, targets):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from raybench.runtime.techniques import lora

    shape = ModelShape("llama", 256, 3, 4, 2, 512, 1000, 2048, False)
    finetune, _, variant = finetune.partition("-")
    train = TrainSpec(strategy=strategy, precision=precision, finetune=finetune,
                      lora=LoraSpec(rank=8, targets=targets, base_dtype="fp32" if variant == "fp32-base" else "auto",
                                    dropout=0.1 if variant == "dropout" else 0.0))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **shape.hf_config_kwargs()),
                                             dtype=torch.float32, attn_implementation="sdpa")
    if finetune == "lora":
        model = lora.apply(model, train)
    if strategy == "fsdp2":
        model = model.to(torch.bfloat16)  # what FSDP2's MixedPrecisionPolicy computes with
    measured = _saved_bytes_per_token(model, 3, 50, autocast=strategy == "ddp" and precision == "bf16")
    # The model leaves out RMSNorm's per-token rsqrt (4 bytes per norm): 8 bytes per token in ~10^4.
    assert measured == pytest.approx(sum(estimate.block_activation_bytes(shape, train)), abs=8.5)


def test_step_time_guess_only_with_a_known_peak():
    config = trial("fsdp2")
    e = est(config, gpu="H100 SXM")
    tokens_per_gpu = 2048  # micro_batch 1 x seq 2048 per rank
    flops_per_token = 6 * (N - VH) + 12 * L * 2048 * H  # metrics' model: 6N (no input embedding) + attention
    assert e.flops_per_step == pytest.approx(flops_per_token * tokens_per_gpu)
    assert e.step_time_s == pytest.approx(e.flops_per_step / (989e12 * estimate.ASSUMED_MFU))
    assert est(config, gpu="Some Future GPU").step_time_s is None  # no peak in the table: no guess
    assert est(config).step_time_s is None
    cpu = trial("ddp", workers=2, gpus=0, preset="tiny", precision="fp32")
    assert est(cpu, gpu="H100 SXM").step_time_s is None  # CPU trials never get a GPU's guess
    recomputed = est(config, range(L), gpu="H100 SXM").flops_per_step - e.flops_per_step
    assert recomputed == pytest.approx(L * (2 * BLOCK + 4 * 2048 * H) * tokens_per_gpu)  # one more forward


def tiny_sweep(tmp_path, estimate_section: dict, **axes) -> dict:
    return {"name": "est", "model": {"preset": "tiny"}, "store": str(tmp_path / "store"),
            "train": {"seq_len": 2048, "precision": "fp32", "steps": 4, "warmup_steps": 1},
            "resources": {"workers": 2}, "axes": axes or {"train.micro_batch": [1, 256]},
            "estimate": estimate_section}


def test_pruning_marks_trials_that_do_not_fit_as_skipped(tmp_path):
    small, big = plan(parse_sweep(tiny_sweep(tmp_path, {"device_memory_gib": 4})))
    assert small.status == "planned" and small.assessment.fits is True
    assert big.status == "skipped" and big.assessment.fits is False
    peak = big.assessment.peak_calibrated_gib
    assert peak > 4 and big.assessment.margin_gib == pytest.approx(0.4)  # default margin: 10% of the memory
    (reason,) = big.reasons
    assert f"estimated peak {peak:.1f} GiB per worker" in reason and "exceeds the 4.0 GiB" in reason
    assert big.payload.to_dict()["estimate"]["peak_gib"] == big.assessment.analytic.peak_gib
    kept = plan(parse_sweep(tiny_sweep(tmp_path, {"device_memory_gib": 4, "prune": False})))
    assert [t.status for t in kept] == ["planned", "planned"] and kept[1].assessment.fits is False
    unknown = plan(parse_sweep(tiny_sweep(tmp_path, {"gpu": "H100 SXM"})))  # the GPU table is for GPU trials
    assert [t.status for t in unknown] == ["planned", "planned"] and unknown[1].assessment.memory_gib is None


# The keys payloads (Tune trial configs, torchrun's payload file), `plan --json` and `estimate --json` carry.
SERIALIZED_KEYS = {
    "device", "params_total", "params_trainable", "params_gib", "grads_gib", "optimizer_gib", "activations_gib",
    "other_gib", "offloaded_gib", "flops_per_step", "step_time_s", "peak_gib", "measured_part_gib", "calibration",
    "calibration_rows", "peak_calibrated_gib", "memory_gib", "margin_gib", "fits", "peak_basis",
    "rehearsed_peak_gib", "rehearsed_step_time_s", "rehearsed_compute_s", "world_size", "peak_interval_gib",
    "step_time_interval_s"}


def test_the_assessment_travels_as_plain_data(tmp_path):
    small, big = plan(parse_sweep(tiny_sweep(tmp_path, {"device_memory_gib": 4})))
    data = big.payload.to_dict()
    assert set(data["estimate"]) == SERIALIZED_KEYS and data["estimate"]["fits"] is False
    assert data["estimate"]["peak_gib"] == big.assessment.analytic.peak_gib
    assert TrialPayload.from_dict(json.loads(json.dumps(data))) == big.payload
    assert big.assessment.limit_gib == pytest.approx(4 - 0.4)
    invalid = TrialPayload.from_dict({**small.payload.to_dict(), "estimate": {}})  # an invalid point's
    assert invalid.assessment is None and invalid.to_dict()["estimate"] == {}


def test_the_plans_assessment_converts_to_and_from_the_payloads_plain_data(tmp_path):
    """The payload (spec layer) holds the assessment as AssessmentData; planning's Assessment converts both ways,
    and what a row reads of it comes from the plain data alone."""
    _, big = plan(parse_sweep(tiny_sweep(tmp_path, {"device_memory_gib": 4})))
    carried = big.payload.assessment
    assert isinstance(carried, AssessmentData) and carried == big.assessment.to_data()
    assert Assessment.from_data(carried) == big.assessment
    analytic = big.assessment.analytic
    assert (carried.analytic_peak_gib, carried.measured_part_gib, carried.analytic_step_time_s) == (
        analytic.peak_gib, analytic.measured_part_gib, analytic.step_time_s)
    assert carried.peak_calibrated_gib == big.assessment.peak_calibrated_gib


def test_margin_in_gib_and_the_gpu_table(tmp_path):
    sweep = tiny_sweep(tmp_path, {"gpu": "H100 SXM", "margin_gib": 2}, **{"train.micro_batch": [1, 1024]})
    sweep["resources"]["gpus_per_worker"] = 1
    sweep["train"]["loss"] = "full"  # its logits put the big trial over the memory
    small, big = plan(parse_sweep(sweep))
    assert small.assessment.memory_gib == pytest.approx(81559 / 1024) and small.assessment.margin_gib == 2
    assert big.status == "skipped" and "of one H100 SXM" in big.reasons[0]


def test_plan_and_estimate_commands_show_it(tmp_path, capsys):
    path = tmp_path / "sweep.json"  # JSON is YAML
    path.write_text(json.dumps(tiny_sweep(tmp_path, {"device_memory_gib": 4})))
    assert cli.main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "skipped: estimated peak" in out and "planned" in out
    assert cli.main(["estimate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "analytic GiB" in out and "reserved+ctx: reserved plus the CUDA context" in out
    assert "NO" in out and "yes" in out and "1 skipped by pruning" in out
    assert cli.main(["estimate", str(path), "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [x["status"] for x in lines] == ["planned", "skipped"]
    assert lines[1]["estimate"]["peak_gib"] > lines[0]["estimate"]["peak_gib"] > estimate.HOST_BASELINE_GIB
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(tiny_sweep(tmp_path, {"gpu": "Voodoo2"})))
    assert cli.main(["estimate", str(bad)]) == 2
    assert "estimate.gpu = 'Voodoo2'" in capsys.readouterr().err


def _ok_row(i: int, error: float | None, strategy: str = "ddp", device: str = "cpu", status: str = "ok") -> dict:
    return {"sweep": "old", "trial_id": f"t{i}", "status": status, "model_preset": "tiny", "train_strategy": strategy,
            "device_type": device, "est_peak_error": error, "ended_at": datetime(2026, 1, 1, tzinfo=timezone.utc)}


def test_calibration_from_stored_rows(tmp_path):
    root = tmp_path / "store"
    rows = [_ok_row(0, 0.2), _ok_row(1, 0.5), _ok_row(2, 0.3), _ok_row(3, None), _ok_row(4, 3.0, status="oom"),
            _ok_row(5, -0.5, strategy="fsdp2"), _ok_row(6, 0.1, device="cuda")]
    for row in rows:
        store.write_row(root, row)
    factors = calibration.factors(root)
    assert factors[("tiny", "ddp", "cpu")] == (pytest.approx(1.3), 3)  # median of 1.2, 1.5, 1.3
    assert factors[("tiny", "fsdp2", "cpu")] == (pytest.approx(0.5), 1)
    assert factors[("tiny", "ddp", "cuda")] == (pytest.approx(1.1), 1)
    assert calibration.factors(tmp_path / "nowhere") == {}

    sweep = tiny_sweep(tmp_path, {}, **{"train.strategy": ["ddp", "fsdp2"]})
    ddp, fsdp2 = plan(parse_sweep(sweep), store_path=root)
    assert ddp.assessment.calibration == pytest.approx(1.3) and ddp.assessment.calibration_rows == 3
    assert ddp.assessment.peak_calibrated_gib == pytest.approx(1.3 * ddp.assessment.analytic.peak_gib)
    assert fsdp2.assessment.peak_calibrated_gib == pytest.approx(0.5 * fsdp2.assessment.analytic.peak_gib)
    assert plan(parse_sweep(sweep))[0].assessment.calibration is None  # no store, no calibration

    sweep["resources"]["gpus_per_worker"] = 1  # on a GPU the CUDA context is outside what was measured
    cuda = plan(parse_sweep(sweep), store_path=root)[0].assessment
    assert cuda.peak_calibrated_gib == pytest.approx(1.0 + 1.1 * (cuda.analytic.peak_gib - 1.0))

    # A trial whose raw estimate fits but whose calibrated one does not is pruned, and says why.
    raw = ddp.assessment.analytic.peak_gib
    sweep = tiny_sweep(tmp_path, {"device_memory_gib": raw * 1.2, "margin_gib": 0}, **{"train.strategy": ["ddp"]})
    assert plan(parse_sweep(sweep))[0].status == "planned"
    (pruned,) = plan(parse_sweep(sweep), store_path=root)
    assert pruned.status == "skipped" and "x1.30 calibrated from 3 measured row(s)" in pruned.reasons[0]


def test_build_row_stores_the_estimate_and_its_error(tmp_path):
    t = plan(parse_sweep(tiny_sweep(tmp_path, {})))[0]
    payload, e = t.payload, t.assessment.analytic
    row = build_row(payload, "est", "ok", "", RankResult.from_columns({"peak_rss_gib": 0.6, "device_type": "cpu"}))
    assert row["est_peak_gib"] == e.peak_gib
    assert row["est_peak_calibrated_gib"] == t.assessment.peak_calibrated_gib
    assert row["est_peak_error"] == pytest.approx(0.6 / e.measured_part_gib - 1)
    assert row["est_step_time_s"] is None  # CPU
    failed = build_row(payload, "est", "oom", "OutOfMemoryError")
    assert "est_peak_error" not in failed and failed["est_peak_gib"] == e.peak_gib
    gpu = build_row(payload, "est", "ok", "", RankResult.from_columns({"peak_reserved_gib": 2.0, "peak_rss_gib": 9.0,
                                                                       "device_type": "cuda"}))
    assert gpu["est_peak_error"] == pytest.approx(2.0 / e.measured_part_gib - 1)
    store.write_row(tmp_path / "rows", row)
    back = store.read_results(tmp_path / "rows").iloc[0]
    assert math.isclose(back.est_peak_error, row["est_peak_error"]) and back.est_peak_gib == e.peak_gib


def test_skipped_trials_become_rows_once_and_never_hide_a_measurement(tmp_path):
    spec = parse_sweep(tiny_sweep(tmp_path, {"device_memory_gib": 4}, **{"train.micro_batch": [256, 512]}))
    root = tmp_path / "store"
    assert run_sweep(spec, store_path=str(root), progress=lambda line: None).ran == []  # nothing ran, no Ray
    rows = store.read_results(root)
    assert sorted(rows.status) == ["skipped", "skipped"]
    assert all(rows.message.str.startswith("estimated peak")) and rows.est_peak_gib.gt(4).all()
    assert rows.est_peak_error.isna().all()
    files = store.result_files(root)
    run_sweep(spec, store_path=str(root), progress=lambda line: None)
    assert store.result_files(root) == files  # the same skipped rows are not written again

    measured = tmp_path / "measured"  # a trial that once ran keeps its measured row as the latest
    first = plan(spec)[0]
    measured_row = build_row(first.payload, "est", "ok", "", RankResult.from_columns({"peak_rss_gib": 30.0}))
    store.write_row(measured, measured_row)
    run_sweep(spec, store_path=str(measured), progress=lambda line: None)
    latest = store.read_results(measured).set_index("trial_id").status
    assert latest[first.trial_id] == "ok" and sorted(latest) == ["ok", "skipped"]


def test_estimate_table_puts_an_invalid_points_reason_under_status(tmp_path):
    sweep = tiny_sweep(tmp_path, {}, **{"train.tp_size": [1, 3]})  # tp 3 on 2 workers: invalid
    table = tables.estimate_table(plan(parse_sweep(sweep), keep_invalid=True))
    header, invalid = table.splitlines()[0], [line for line in table.splitlines() if "invalid:" in line]
    assert len(invalid) == 1 and invalid[0].index("invalid:") == header.index("status")
