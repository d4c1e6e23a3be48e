"""Plan-time compatibility rules for strategies and techniques, bundle axes, train.env, and the clear errors
GPU-only techniques raise on CPU."""

from __future__ import annotations

import json

import pytest
import torch

from raybench.planning.plan import plan
from raybench.results.store import CONFIG_COLUMNS, flatten_config
from raybench.spec.errors import ConfigError
from raybench.spec.load import parse_sweep

BASE = {"name": "rules", "model": {"preset": "tiny"}, "train": {"steps": 4, "warmup_steps": 1}}


def rule_problems(train: dict = None, resources: dict = None, data: dict = None, model: dict = None) -> dict:
    """{field: messages joined} of the plan-time problems for one trial of the tiny preset."""
    raw = {**BASE, "train": {**BASE["train"], **(train or {})}, "resources": resources or {},
           "data": data or {}, "model": {**BASE["model"], **(model or {})}}
    with pytest.raises(ConfigError) as info:
        plan(parse_sweep(raw))
    found: dict[str, str] = {}
    for p in info.value.problems:
        found[p.field] = f"{found.get(p.field, '')} | {p.message}"
    return found


@pytest.mark.parametrize("train, resources, field, words", [
    ({"strategy": "tp", "tp_size": 2}, {"workers": 4}, "train.tp_size", "set train.tp_size: 4"),
    ({"strategy": "tp_fsdp2", "tp_size": 3}, {"workers": 4}, "train.tp_size", "divides resources.workers"),
    ({"strategy": "tp", "tp_size": 4}, {"workers": 4}, "train.tp_size", "2 KV heads"),
    ({"strategy": "deepspeed", "tp_size": 2}, {"workers": 2}, "train.tp_size", "not supported"),
    ({"strategy": "ddp", "tp_size": 2}, {"workers": 2}, "train.tp_size", "tp_size: 1"),
    ({"finetune": "qlora"}, {}, "train.finetune", "needs CUDA"),
    ({"liger": True}, {}, "train.liger", "need CUDA"),
    ({"fp8": "tensorwise"}, {}, "train.fp8", "FP8 tensor cores"),
    ({"fp8": "rowwise", "strategy": "tp", "tp_size": 2}, {"workers": 2, "gpus_per_worker": 1}, "train.fp8",
     "ddp and fsdp2, not tp"),
    ({"fp8": "rowwise", "precision": "fp32"}, {"gpus_per_worker": 1}, "train.fp8", "train.precision: bf16"),
    ({"fp8": "tensorwise", "finetune": "qlora"}, {"gpus_per_worker": 1}, "train.fp8", "4-bit"),
    ({"reduce_dtype": "bf16", "strategy": "ddp"}, {}, "train.reduce_dtype", "fsdp2 or tp_fsdp2"),
    ({"reduce_dtype": "bf16", "strategy": "fsdp2", "precision": "fp32"}, {}, "train.reduce_dtype",
     "train.reduce_dtype: fp32"),
    ({"precision": "fp16", "grad_scaler": False}, {}, "train.grad_scaler", "underflow"),
    ({"precision": "fp16", "strategy": "fsdp2"}, {}, "train.precision", "use bf16"),
    ({"strategy": "deepspeed", "offload": "optimizer"}, {}, "train.offload", "needs GPUs"),
    ({"strategy": "ddp", "offload": "optimizer"}, {}, "train.offload", "DeepSpeed ZeRO option"),
    ({"ac_mode": "op"}, {}, "train.ac_mode", "set train.ac_ratio"),
    ({"ac_ratio": "1", "ac_saved_ops": ["mm"]}, {}, "train.ac_saved_ops", "set train.ac_mode: op"),
    ({"optimizer": "adafactor", "strategy": "fsdp2"}, {}, "train.optimizer", "DTensor"),
])
def test_incompatible_combinations_are_rejected_with_the_field(train, resources, field, words):
    found = rule_problems(train, resources)
    assert field in found and words in found[field], found


def test_zero3_param_offload_needs_stage_3_even_on_gpus():
    found = rule_problems({"strategy": "deepspeed", "offload": "optimizer_params", "zero_stage": 2},
                          {"gpus_per_worker": 1})
    assert "zero_stage: 3" in found["train.offload"]


def test_data_and_attention_rules():
    assert "num_workers" in rule_problems(data={"prefetch_factor": 4})["data.prefetch_factor"]
    assert "CUDA" in rule_problems(model={"attn_implementation": "flash_attention_2"})["model.attn_implementation"]
    assert "no backward on CPU" in rule_problems(model={"attn_implementation": "flex_attention"})[
        "model.attn_implementation"]


def test_valid_combinations_plan():
    for train, workers in [({"strategy": "tp", "tp_size": 2}, 2), ({"strategy": "tp_fsdp2", "tp_size": 2}, 4),
                           ({"strategy": "tp", "tp_size": 2, "finetune": "lora"}, 2),
                           ({"strategy": "tp_fsdp2", "tp_size": 2, "finetune": "lora", "lora": {"dropout": 0.1}}, 4),
                           ({"strategy": "deepspeed", "zero_stage": 3}, 2), ({"ac_mode": "op", "ac_ratio": 1}, 2),
                           ({"precision": "fp16"}, 2), ({"optimizer": "adafactor"}, 1)]:
        raw = {**BASE, "train": {**BASE["train"], **train}, "resources": {"workers": workers}}
        assert plan(parse_sweep(raw))[0].status == "planned"


@pytest.mark.parametrize("train, words", [
    ({"precision": "fp32", "lora": {"base_dtype": "bf16"}}, "base_dtype bf16 under precision fp32"),
    ({"precision": "bf16", "lora": {"base_dtype": "fp16"}}, "base_dtype fp16 differs from the compute dtype bf16"),
    ({"strategy": "deepspeed", "lora": {"base_dtype": "fp32"}}, "DeepSpeed casts the whole model to bf16"),
])
def test_a_lora_base_the_run_cannot_keep_is_refused_with_a_fix(train, words):
    found = rule_problems({"finetune": "lora", **train})["train.lora.base_dtype"]
    assert words in found and "set train.lora.base_dtype: auto" in found, found


def test_qlora_takes_no_base_dtype_and_other_lora_bases_plan():
    assert "4-bit" in rule_problems({"finetune": "qlora", "lora": {"base_dtype": "bf16"}})["train.lora.base_dtype"]
    for train in ({"lora": {"base_dtype": "fp32"}}, {"strategy": "fsdp2", "lora": {"base_dtype": "fp32"}},
                  {"precision": "fp16", "lora": {"base_dtype": "fp16"}}, {"precision": "fp32"},
                  {"strategy": "deepspeed"}, {"strategy": "deepspeed", "precision": "fp32",
                                              "lora": {"base_dtype": "fp32"}}):
        raw = {**BASE, "train": {**BASE["train"], "finetune": "lora", **train}}
        assert plan(parse_sweep(raw))[0].status == "planned", train


def test_keep_invalid_records_the_reason():
    raw = {**BASE, "axes": {"train.finetune": ["lora", "qlora"]}}
    trials = plan(parse_sweep(raw), keep_invalid=True)
    assert [t.status for t in trials] == ["planned", "invalid"] and "CUDA" in trials[1].reasons[0]


def test_bundle_axis_sets_fields_together_and_shows_each():
    raw = {**BASE, "axes": {"setup": [{"train.strategy": "ddp"},
                                      {"train.strategy": "tp", "train.tp_size": 2, "resources.workers": 2}],
                            "train.micro_batch": [1, 2]}}
    trials = plan(parse_sweep(raw))
    assert len(trials) == 4
    assert trials[2].axis_values == {"train.strategy": "tp", "train.tp_size": 2, "resources.workers": 2,
                                     "train.micro_batch": 1}
    assert trials[2].config.train.tp_size == 2 and trials[2].world_size == 2


@pytest.mark.parametrize("axes, field", [
    ({"setup": [{"train.strategy": "dpp"}]}, "axes.setup[0].train.strategy"),
    ({"setup": [{"train.stratgy": "ddp"}]}, "axes.setup"),
    ({"setup": ["ddp"]}, "axes.setup"),
    ({"train": [{"train.strategy": "ddp"}]}, "axes.train"),
])
def test_bad_bundle_axes_name_the_field(axes, field):
    with pytest.raises(ConfigError) as info:
        parse_sweep({**BASE, "axes": axes})
    assert field in {p.field for p in info.value.problems}, info.value.report()


def test_env_is_checked_and_stored_as_json():
    spec = parse_sweep({**BASE, "train": {**BASE["train"], "env": {"NCCL_SOCKET_NTHREADS": 4}}})
    assert spec.train.env == {"NCCL_SOCKET_NTHREADS": "4"}
    row = flatten_config(plan(spec)[0].config.model_dump(mode="json"))
    assert json.loads(row["train_env_json"]) == {"NCCL_SOCKET_NTHREADS": "4"}
    assert "train_env_json" in {c for c, _, _ in CONFIG_COLUMNS}
    with pytest.raises(ConfigError) as info:
        parse_sweep({**BASE, "train": {"env": {"LD_PRELOAD": "/tmp/x.so"}}})
    assert info.value.problems[0].field == "train.env" and "NCCL_" in info.value.problems[0].message


def test_gpu_only_techniques_fail_clearly_on_cpu():
    from transformers import LlamaConfig, LlamaForCausalLM

    from raybench.runtime.techniques import fp8, liger, qlora
    from raybench.spec.sweep_spec import TrainSpec

    if torch.cuda.is_available():
        pytest.skip("checks the CPU error path")
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
    with pytest.raises(ValueError, match="qlora needs CUDA"):
        qlora.apply(model, TrainSpec(finetune="qlora"))
    with pytest.raises(ValueError, match="liger=true needs CUDA"):
        liger.apply(model, TrainSpec(liger=True))
    with pytest.raises(ValueError, match="fp8=rowwise needs CUDA"):
        fp8.apply(model, TrainSpec(fp8="rowwise"))


def test_deepspeed_offload_fails_clearly_on_cpu():
    from raybench.runtime.strategies import RankContext, deepspeed
    from raybench.spec.sweep_spec import TrainSpec

    ctx = RankContext(0, 1, 0, torch.device("cpu"))
    with pytest.raises(ValueError, match="offload='optimizer' .* needs GPUs"):
        deepspeed.setup(torch.nn.Linear(2, 2), TrainSpec(strategy="deepspeed", offload="optimizer"), ctx)


def test_deepspeed_config_uses_no_jit_optimizer():
    from raybench.runtime.strategies.deepspeed import ds_config
    from raybench.spec.sweep_spec import TrainSpec

    config = ds_config(TrainSpec(strategy="deepspeed", zero_stage=3, micro_batch=2, grad_accum=4), 8, True)
    assert "optimizer" not in config  # a config optimizer would JIT-build fused_adam
    assert config["train_batch_size"] == 2 * 4 * 8 and config["zero_optimization"]["stage"] == 3


def _rank_env(tmp_path, gpus: int, env: dict | None = None) -> dict:
    """The environment a command trial's ranks start with (the executors all add payload.worker_env the same way)."""
    from raybench.drivers.executors import command

    sweep = {**BASE, "train": {**BASE["train"], "env": env or {}}, "resources": {"gpus_per_worker": gpus},
             "stack": {"kind": "command", "command": ["{python}", "train.py", "--steps", "{steps}"]}}
    payload = plan(parse_sweep(sweep))[0].payload
    return command._command_env(payload, tmp_path, str(tmp_path))


def test_cpu_trials_of_raybenchs_loop_get_a_fixed_mmap_threshold_that_train_env_replaces_or_removes(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)

    def start_env(gpus: int, env: dict | None = None) -> dict:
        sweep = {**BASE, "train": {**BASE["train"], "env": env or {}}, "resources": {"gpus_per_worker": gpus}}
        return plan(parse_sweep(sweep))[0].payload.start_env()

    assert start_env(gpus=0)["MALLOC_MMAP_THRESHOLD_"] == "131072"  # glibc's initial threshold, fixed
    assert "MALLOC_MMAP_THRESHOLD_" not in start_env(gpus=1)
    assert start_env(0, {"MALLOC_MMAP_THRESHOLD_": 65536})["MALLOC_MMAP_THRESHOLD_"] == "65536"
    # Empty: none at all (glibc would read an empty value as 0, mapping every allocation).
    assert "MALLOC_MMAP_THRESHOLD_" not in start_env(0, {"MALLOC_MMAP_THRESHOLD_": ""})
    assert "MALLOC_MMAP_THRESHOLD_" not in start_env(1, {"MALLOC_MMAP_THRESHOLD_": ""})


def test_a_users_stack_runs_in_the_scripts_own_malloc_settings_unless_train_env_sets_a_threshold(tmp_path,
                                                                                                  monkeypatch):
    # A fixed threshold made the shipped command and hf scripts 1.3x to 2x slower than the same scripts started by
    # hand (docs/results/inside-outside-2026-11-28.md): a stack's trial must time as its script does alone.
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert "MALLOC_MMAP_THRESHOLD_" not in _rank_env(tmp_path, gpus=0)
    assert _rank_env(tmp_path, 0, {"MALLOC_MMAP_THRESHOLD_": 131072})["MALLOC_MMAP_THRESHOLD_"] == "131072"


@pytest.mark.parametrize("value", [-1, "64k", 2**26, True, 1.5])
def test_a_bad_mmap_threshold_names_the_field_the_value_and_the_range(value):
    with pytest.raises(ConfigError) as info:
        parse_sweep({**BASE, "train": {"env": {"MALLOC_MMAP_THRESHOLD_": value}}})
    problem = info.value.problems[0]
    assert problem.field == "train.env" and "from 0 to 33554432" in problem.message and "or ''" in problem.message


@pytest.mark.parametrize("stack", [None, "command"])
def test_ranks_launched_without_ray_get_the_threads_ray_gives_a_worker(tmp_path, monkeypatch, stack):
    """torchrun leaves one rank every core of the machine: a trial of one 1-CPU rank ran 18% faster under
    `raybench trial` than as a Ray Train worker, whose threads Ray sets to its CPUs
    (docs/results/inside-outside-2026-11-28.md). Both launchers without Ray set them; train.env may still."""
    from raybench.drivers.executors import command, torchrun

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def env(cpus: int, train_env: dict | None = None) -> dict:
        sweep = {**BASE, "train": {**BASE["train"], "env": train_env or {}},
                 "resources": {"workers": 1, "cpus_per_worker": cpus}}
        if stack:
            sweep["stack"] = {"kind": "command", "command": ["{python}", "train.py", "--steps", "{steps}"]}
        payload = plan(parse_sweep(sweep))[0].payload
        return command._command_env(payload, tmp_path, str(tmp_path)) if stack else torchrun.launch_env(payload)

    assert env(1)["OMP_NUM_THREADS"] == "1" and env(3)["OMP_NUM_THREADS"] == "3"
    assert env(1, {"OMP_NUM_THREADS": "2"})["OMP_NUM_THREADS"] == "2"
