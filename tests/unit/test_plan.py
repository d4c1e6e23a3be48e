"""Grid expansion, stable content-hash ids, sAC placement."""

from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import yaml

from raybench.planning.plan import config_id, plan
from raybench.results.store import measured_trial_config
from raybench.spec.errors import ConfigError
from raybench.spec.load import PLACEHOLDER, load_sweep, parse_sweep
from raybench.spec.sac import checkpointed_blocks
from raybench.spec.sweep_spec import TrialConfig

REPO = Path(__file__).resolve().parents[2]
# User sweeps (sweeps/) and the project's own regression sweeps (bench/sweeps/): every shipped sweep plans.
BENCH_SWEEPS = REPO / "bench" / "sweeps"
# The sweeps on `raybench example-data`'s files validate next to a fresh copy of them in test_example_data.py.
SWEEPS = [p for p in sorted((REPO / "sweeps").glob("*.yaml")) + sorted(BENCH_SWEEPS.glob("*.yaml"))
          if "example-data/" not in p.read_text()]


@pytest.mark.parametrize("ratio, layers, expected", [
    (Fraction(1, 2), 6, [0, 2, 4]),
    (Fraction(1, 3), 6, [1, 4]),
    (Fraction(2, 3), 6, [0, 2, 3, 5]),
    (Fraction(0), 4, []),
    (Fraction(1), 4, [0, 1, 2, 3]),
    (Fraction(1, 4), 16, [1, 5, 9, 13]),
])
def test_sac_placement_matches_design(ratio, layers, expected):
    assert checkpointed_blocks(ratio, layers) == expected


@pytest.mark.parametrize("layers", [1, 7, 16, 80])
def test_sac_count_is_rounded_share(layers):
    for num in range(0, 9):
        ratio = Fraction(num, 8)
        assert len(checkpointed_blocks(ratio, layers)) == int(layers * ratio + Fraction(1, 2))


def test_grid_expands_in_declared_order_with_repeats():
    spec = parse_sweep({"name": "g", "model": {"preset": "tiny"}, "repeats": 2,
                        "axes": {"train.strategy": ["ddp", "fsdp2"], "train.micro_batch": [1, 2, 4]},
                        "exclude": [{"train.strategy": "fsdp2", "train.micro_batch": 4}]})
    trials = plan(spec)
    points = [(t.axis_values["train.strategy"], t.axis_values["train.micro_batch"]) for t in trials[::2]]
    assert points == [("ddp", 1), ("ddp", 2), ("ddp", 4), ("fsdp2", 1), ("fsdp2", 2)]
    assert [t.repeat for t in trials[:2]] == [0, 1]
    assert trials[0].config_id == trials[1].config_id and trials[0].trial_id != trials[1].trial_id
    assert len({t.trial_id for t in trials}) == len(trials) == 10


def test_ids_depend_on_config_not_on_order_or_name():
    a = plan(parse_sweep({"name": "a", "model": {"preset": "tiny"}, "axes": {"train.micro_batch": [1, 2]}}))
    b = plan(parse_sweep({"name": "b", "model": {"preset": "tiny"}, "axes": {"train.micro_batch": [2, 1]}}))
    assert {t.trial_id for t in a} == {t.trial_id for t in b}
    c = plan(parse_sweep({"name": "a", "model": {"preset": "tiny"}, "train": {"lr": 2e-5},
                          "axes": {"train.micro_batch": [1, 2]}}))
    assert not {t.trial_id for t in a} & {t.trial_id for t in c}


def test_committed_gpu_rows_keep_their_ids():
    """Trial ids hash the config: a field added later (train.ac_saved_ops) must not change the ids of configs
    that leave it unset, or stored rows would no longer match their trials (resume, rehearse validation)."""
    import pandas as pd

    for sweep in ("gpu-sac-1b",):  # gpu-seed000-1gpu's LoRA rows: the next test
        rows = pd.read_parquet(REPO / "docs" / "results" / "gpu-2026-11-22" / f"{sweep}.parquet")
        planned = {t.config_id for t in plan(load_sweep(BENCH_SWEEPS / f"{sweep}.yaml"))}
        assert planned <= set(rows.config_id), sweep


def test_lora_8b_sweep_gained_the_public_point_and_kept_its_grids_ids():
    """sweeps/lora-8b-1gpu.yaml's public one-H100 point (issue 49) came after its grid of eight: those keep their
    ids and plan indices, and the point is the public configuration exactly. Since train.loss auto, the grid's
    full-AC points run the full loss (the whole logits fit beside a checkpointed step), and so are new trials."""
    trials = plan(load_sweep(REPO / "sweeps" / "lora-8b-1gpu.yaml"))
    assert [t.trial_id for t in trials[:8:2]] == [
        "6c96f24aea2f5209-r0", "f814eee74e7491cf-r0", "b39b1f95f66c2962-r0", "1f694b538cf428d1-r0"]
    assert [t.config.train.loss for t in trials] == ["chunked", "full"] * 4 + ["chunked"]
    assert len(trials) == 9
    public = trials[8].config
    assert public.model.preset == "llama-3-8b"
    lora = public.train.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.targets) == (16, 32, 0.1, "all_linear")
    train = public.train
    assert (train.micro_batch, train.seq_len, train.grad_accum, train.ac_ratio) == (2, 4096, 16, "0")
    assert (train.strategy, train.precision, train.lora_base_dtype, train.optimizer) == (
        "fsdp2", "bf16", "bf16", "adamw_fused")


def test_committed_lora_rows_from_before_the_base_dtype_get_new_ids_and_read_as_measured():
    """train.lora.base_dtype changed what a LoRA trial measures (auto: a bf16 base where it was fp32), so the
    seed 000 LoRA rows' configurations plan under new ids; read back, their configs say what they measured."""
    import pandas as pd

    rows = pd.read_parquet(REPO / "docs" / "results" / "gpu-2026-11-22" / "gpu-seed000-1gpu.parquet")
    trials = plan(load_sweep(BENCH_SWEEPS / "gpu-seed000-1gpu.yaml"))
    assert {t.config.train.lora_base_dtype for t in trials} == {"bf16"}
    assert not {t.config_id for t in trials} & set(rows.config_id)
    as_written = {config_id(TrialConfig.model_validate(json.loads(c))) for c in rows.config_json}
    assert {t.config_id for t in trials} <= as_written  # only the base dtype differs
    measured = [measured_trial_config(c) for c in rows.config_json]
    assert {c.train.lora_base_dtype for c in measured} == {"fp32"}  # fsdp2 kept an fp32 base then


def test_full_finetune_and_qlora_trials_keep_their_ids():
    """Ids computed before train.lora.base_dtype existed: the field is left out of every dump but LoRA's."""
    full = TrialConfig.model_validate({"model": {"preset": "tiny"}})
    qlora = TrialConfig.model_validate({"model": {"preset": "tiny"}, "train": {"finetune": "qlora"}})
    assert (config_id(full), config_id(qlora)) == ("f93ad76455577afa", "bf5fee9e7d11ac94")
    set_anyway = TrialConfig.model_validate({"model": {"preset": "tiny"}, "train": {"lora": {"base_dtype": "fp32"}}})
    assert config_id(set_anyway) == config_id(full)


def test_lora_ids_hash_the_resolved_base_dtype():
    def lora_id(**train) -> str:
        return config_id(TrialConfig.model_validate({"model": {"preset": "tiny"},
                                                     "train": {"finetune": "lora", **train}}))

    assert lora_id() == lora_id(lora={"base_dtype": "bf16"}) != lora_id(lora={"base_dtype": "fp32"})
    assert lora_id(precision="fp32") == lora_id(precision="fp32", lora={"base_dtype": "fp32"})
    assert lora_id(strategy="deepspeed") == lora_id(strategy="deepspeed", lora={"base_dtype": "bf16"})


def test_axes_resolve_the_lora_base_dtype_per_grid_point():
    """The sweep's base trial keeps auto as written: an axis over precision resolves it again at each point."""
    spec = parse_sweep({"name": "b", "model": {"preset": "tiny"}, "train": {"finetune": "lora"},
                        "axes": {"train.precision": ["bf16", "fp32"]}})
    assert [t.config.train.lora_base_dtype for t in plan(spec)] == ["bf16", "fp32"]


def test_plan_output_identical_across_processes():
    cmd = [sys.executable, "-m", "raybench", "plan", str(REPO / "sweeps" / "smoke-cpu.yaml")]
    first = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    second = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert first == second and "0,2" in first


def test_ten_thousand_point_grid_plans():
    trials = plan(load_sweep(BENCH_SWEEPS / "grid-10k.yaml"))
    assert len(trials) == 10_000
    assert len({t.trial_id for t in trials}) == 10_000


@pytest.mark.parametrize("path", SWEEPS, ids=[str(p.relative_to(REPO)) for p in SWEEPS])
def test_every_shipped_sweep_validates_and_plans(path, request):
    if PLACEHOLDER not in path.read_text():
        assert plan(load_sweep(path))
        return
    # A sweep on the user's own copy of a dataset: refused as shipped, naming each path to set, and valid once
    # they point at a model, data of the sweep's format and a tokenizer (made here, as a user's would be).
    with pytest.raises(ConfigError) as refused:
        load_sweep(path)
    assert all("placeholder" in p.message for p in refused.value.problems)
    raw = yaml.safe_load(path.read_text())
    data = raw.get("data") or {}  # a torchtune stack's data is its own config's
    if data.get("path", "").startswith(PLACEHOLDER):
        data["path"] = str(request.getfixturevalue("alpaca_file" if data["format"] == "alpaca" else "chat_file"))
    if data.get("tokenizer", "").startswith(PLACEHOLDER):
        data["tokenizer"] = str(request.getfixturevalue("chat_tokenizer"))
    if raw["model"].get("path", "").startswith(PLACEHOLDER):
        raw["model"]["path"] = str(request.getfixturevalue("model_dir"))
    stack = raw.get("stack") or {}
    if str(stack.get("python", "")).startswith(PLACEHOLDER):  # a stack's own environment (torchtune's venv)
        stack["python"] = sys.executable
    for key, value in (stack.get("overrides") or {}).items():  # the stack's own paths (a tokenizer, data files)
        if str(value).startswith(PLACEHOLDER):
            stack["overrides"][key] = "/data/" + Path(value).name
    assert plan(parse_sweep(raw, str(path), path.parent))
