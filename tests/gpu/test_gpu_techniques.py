"""GPU-only techniques train on CUDA: QLoRA (bitsandbytes 4-bit), Liger kernels, FP8 linears (torchao), ZeRO offload,
fp16 + GradScaler, FlashAttention-2, compiled and checkpointed TP, activation offloading. Skipped without CUDA (the CPU errors are covered in
tests/unit/test_strategy_rules.py)."""

from __future__ import annotations

import json

import pytest
import torch

from raybench.drivers.executors import torchrun
from raybench.planning.plan import plan
from raybench.spec.load import parse_sweep
from raybench.spec.schema import TrialMetrics

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BASE_TRAIN = {"steps": 10, "warmup_steps": 2, "seq_len": 64, "micro_batch": 2, "precision": "bf16", "lr": 1e-3}


@pytest.fixture
def data(model_dir, alpaca_file) -> dict:
    # Learnable text (random tokens show no learning in a few steps); token ids fit the tiny preset.
    return {"source": "json", "path": str(alpaca_file), "tokenizer": str(model_dir)}


def run_gpu_trial(data: dict, train: dict, model: dict | None = None, workers: int = 1) -> TrialMetrics:
    """Rank 0's metrics of one trial under torchrun."""
    workers = min(workers, torch.cuda.device_count())
    spec = parse_sweep({"name": "gpu", "model": {"preset": "tiny", **(model or {})}, "data": data,
                        "train": {**BASE_TRAIN, **train},
                        "resources": {"workers": workers, "gpus_per_worker": 1, "timeout_s": 600}})
    (trial,) = plan(spec)
    return torchrun.execute(trial.payload).metrics


def assert_learns(result: TrialMetrics) -> None:
    assert result.loss_final < result.loss_first, result
    assert result.peak_alloc_gib > 0


def test_qlora_trains_on_4bit_base(data):
    pytest.importorskip("bitsandbytes")
    result = run_gpu_trial(data, {"finetune": "qlora", "lora": {"rank": 8, "alpha": 16}})
    assert_learns(result)
    assert result.params_trainable < result.params_total / 2


def test_liger_kernels(data):
    pytest.importorskip("liger_kernel")
    assert_learns(run_gpu_trial(data, {"liger": True}))


@pytest.mark.parametrize("offload, stage", [("optimizer", 2), ("optimizer_params", 3)])
def test_deepspeed_offload(data, offload, stage):
    assert_learns(run_gpu_trial(data, {"strategy": "deepspeed", "zero_stage": stage, "offload": offload}))


@pytest.mark.parametrize("recipe, train", [("tensorwise", {"strategy": "fsdp2"}), ("rowwise", {}),
                                           ("tensorwise", {"finetune": "lora"}),
                                           ("tensorwise", {"strategy": "fsdp2", "compile": True, "ac_ratio": "1/2"})])
def test_fp8_trains(data, recipe, train):
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores (compute capability 8.9 or above)")
    result = run_gpu_trial(data, {"fp8": recipe, **train})
    assert_learns(result)
    kinds = json.loads(result.fp8_linear_kinds_json)  # the row names the FP8 matmuls: the tiny model's 7 kinds
    assert len(kinds) == 7 and result.fp8_linears == 7 * 4 and 0 < result.fp8_flops_frac < 1


def test_fp16_with_grad_scaler(data):
    assert_learns(run_gpu_trial(data, {"precision": "fp16"}))


def test_fsdp2_bf16_mixed_precision_and_fused_adamw(data):
    assert_learns(run_gpu_trial(data, {"strategy": "fsdp2", "optimizer": "adamw_fused"}, workers=2))


def test_flash_attention_2(data):
    pytest.importorskip("flash_attn")
    assert_learns(run_gpu_trial(data, {}, model={"attn_implementation": "flash_attention_2"}))


def test_cuda_oom_is_an_oom_row_with_memory_at_oom(tmp_path):
    from raybench.drivers.executors import get
    from raybench.drivers.trial import run_trial
    from raybench.results.store import read_results

    # Logits alone: 4096 x 2048 x 2000 fp32 = 67 GB, beyond one 80 GB GPU with the rest of the step.
    spec = parse_sweep({"name": "gpu-oom", "model": {"preset": "tiny"},
                        "train": {"steps": 3, "warmup_steps": 1, "seq_len": 2048, "micro_batch": 4096,
                                  "precision": "fp32"},
                        "resources": {"workers": 1, "gpus_per_worker": 1, "timeout_s": 600}})
    (trial,) = plan(spec)
    row = run_trial(trial.payload, "gpu-oom", str(tmp_path), "torchrun", get("torchrun"))
    assert row["status"] == "oom", row["message"]
    assert "GiB allocated" in row["message"]
    assert list(read_results(tmp_path).status) == ["oom"]


def test_qlora_counts_the_weights_not_the_packed_storage():
    # Params4bit stores two 4-bit weights per uint8 element; params_total (and so flops_per_token, MFU) must
    # count the weights, as the unquantized model does.
    pytest.importorskip("bitsandbytes")
    from transformers import LlamaConfig, LlamaForCausalLM

    from raybench.runtime.model import count_params
    from raybench.runtime.techniques import qlora
    from raybench.spec.sweep_spec import TrainSpec

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)
    model = LlamaForCausalLM(config).cuda()
    unquantized = count_params(model)[0]
    model = qlora.apply(model, TrainSpec(finetune="qlora"))
    assert any(type(p).__name__ == "Params4bit" for p in model.parameters())  # the swap happened
    assert sum(p.numel() for p in model.parameters()) < unquantized  # packed: numel() alone undercounts
    assert count_params(model)[0] == unquantized


def test_tensor_parallel_compiled_and_checkpointed(data):
    # Compiled inside their checkpoints (compile.compiled_region); one GPU still runs the DTensor graphs whose
    # compiled checkpoint fails in torch 2.13 (tests/unit/test_tp_compile.py), with CUDA's attention kernels.
    workers = min(2, torch.cuda.device_count())
    assert_learns(run_gpu_trial(data, {"strategy": "tp", "tp_size": workers, "compile": True, "ac_ratio": "1"},
                                workers=workers))


def test_activation_offload_trains_in_less_memory(data):
    """train.offload_activations: what the blocks save waits in pinned host memory, so the peak is lower and the
    step trains the same (tests/unit/test_activation_offload.py has its rules and rehearsal)."""
    long = {"strategy": "fsdp2", "seq_len": 1024, "micro_batch": 8}
    kept, offloaded = (run_gpu_trial(data, {**long, "offload_activations": o}) for o in (False, True))
    assert_learns(offloaded)
    assert offloaded.peak_alloc_gib < kept.peak_alloc_gib
    assert offloaded.loss_first == pytest.approx(kept.loss_first, rel=1e-3)
