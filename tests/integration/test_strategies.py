"""Every CPU-capable strategy and technique really trains: a few steps of the tiny preset on 2 gloo ranks
(4 for TP x FSDP2), and the loss goes down with a fixed seed.

The trials of up to 2 ranks run in the warm pool on one local Ray (`executor: pool`): its processes import torch,
transformers and raybench once per group, where torchrun would start fresh ones for each trial (their imports
cost several times a tiny trial's training). A warm trial's losses equal a fresh one's
(test_pool.py::test_warm_trial_equals_fresh_after_other_trials); the 4-rank trials, more ranks than this
machine's CPUs, run under torchrun.

The data is the alpaca-style test text (a small word-level tokenizer; ids fit the tiny preset's vocabulary),
which a model learns within a few steps; uniform random tokens would not show learning that fast. Strategies
that split the same math differently must also agree: DeepSpeed and TP x FSDP2 against DDP, TP against one rank.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from raybench.drivers.executors import pool, torchrun
from raybench.drivers.ray_cluster import ray_cluster
from raybench.planning.plan import plan
from raybench.spec.load import parse_sweep
from raybench.spec.schema import RankResult

pytestmark = pytest.mark.integration

BASE_TRAIN = {"steps": 8, "warmup_steps": 1, "seq_len": 32, "micro_batch": 2, "precision": "fp32", "lr": 1e-3}
# Same data, seed and optimizer, different partitioning: losses agree up to float reordering.
SAME_MATH_ABS = 2e-3
# Learning, not a different batch: at random init the tiny preset's logits have std 0.02 * sqrt(128) = 0.23, so
# every batch's loss is ln(2000) = 7.6 give or take 0.02 (one standard deviation over batches of the test text;
# 20 batches span 0.10). A fall of 0.2 is learning on any processor. No tighter figure holds everywhere: CPU
# fp16 kernels differ between processors, and the fp16 LoRA case falls 0.46 on one and 0.53 on another.
LEARNING_DROP = 0.2
# fp16 keeps 11 significant bits (eps = 2**-10). The tiny preset's forward rounds into fp16 at each of its 29
# linear layers' inputs and weights; independent rounding errors grow as the square root of their number
# (sqrt(58) < 8), so an fp16 forward's loss is within 8 eps (0.8%, 0.06 at 7.6) of the fp32 one's.
FP16_RTOL = 8 * torch.finfo(torch.float16).eps

ALL_LINEAR_LORA = {"finetune": "lora", "lora": {"targets": "all_linear"}, "ac_ratio": "1/2", "lr": 1e-2}
CASES = {
    # name: (train overrides, data overrides, workers), grouped by the pool group each runs in (the order the tests
    # run them in: a group is started once for its run of cases).
    "ddp": ({}, {}, 2),  # the chunked loss (train.loss's default)
    "ddp-full-loss": ({"loss": "full"}, {}, 2),  # transformers' loss over the whole logits
    "ddp-lora-sac-half-fp16": ({"finetune": "lora", "ac_ratio": "1/2", "precision": "fp16", "lr": 1e-2}, {}, 2),
    "ddp-lora-sac-half": ({"finetune": "lora", "ac_ratio": "1/2", "lr": 1e-2}, {}, 2),  # the fp16 case in fp32
    "ddp-compile-ac-full-loaders2": ({"compile": True, "ac_ratio": "1", "optimizer": "adamw_foreach"},
                                     {"num_workers": 2, "prefetch_factor": 4}, 2),
    "fsdp2-op-ac-sgd": ({"strategy": "fsdp2", "ac_ratio": "1", "ac_mode": "op", "optimizer": "sgd", "lr": 0.1},
                        {}, 2),
    "fsdp2-lora": ({"strategy": "fsdp2", "finetune": "lora", "lr": 1e-2}, {}, 2),
    # LoRA split with its base projections (A or B split, the other whole), all-linear targets, sAC on half.
    "tp-lora": ({"strategy": "tp", "tp_size": 2, **ALL_LINEAR_LORA}, {}, 2),
    # compiled: its checkpointed blocks compile inside their checkpoints (compile.compiled_region)
    "tp": ({"strategy": "tp", "tp_size": 2, "ac_ratio": "1/2", "optimizer": "adamw_fused", "compile": True}, {}, 2),
    # Sharded builds give every rank its part of the same random init at any world size
    # (raybench/runtime/materialize.py).
    "fsdp2": ({"strategy": "fsdp2"}, {}, 2),
    # DeepSpeed's ranks start with DS_ACCELERATOR set: a group of their own.
    "zero2-accum2-adafactor": ({"strategy": "deepspeed", "zero_stage": 2, "grad_accum": 2, "optimizer": "adafactor",
                                "lr": 1e-2}, {}, 2),
    "zero3": ({"strategy": "deepspeed", "zero_stage": 3}, {}, 2),
    "ddp-1rank": ({}, {}, 1),
    "ddp-1rank-lora": (ALL_LINEAR_LORA, {}, 1),
    "fsdp2-1rank": ({"strategy": "fsdp2"}, {}, 1),
    "zero3-1rank": ({"strategy": "deepspeed", "zero_stage": 3}, {}, 1),
    # More ranks than CPUs: torchrun.
    "tp-fsdp2": ({"strategy": "tp_fsdp2", "tp_size": 2}, {}, 4),
    "ddp-4ranks": ({}, {}, 4),
    "fsdp2-4ranks": ({"strategy": "fsdp2"}, {}, 4),
    "zero3-4ranks": ({"strategy": "deepspeed", "zero_stage": 3}, {}, 4),
}
_results: dict[str, RankResult] = {}


POOL_MAX_WORKERS = 2  # this machine's CPUs: a pool group holds a CPU per rank


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One local Ray for the file's pool groups (a pool's groups live as long as its Ray)."""
    with ray_cluster(None):
        yield


def run_trial(train: dict, data: dict, workers: int, model_dir, alpaca_file) -> RankResult:
    """Plan one trial of the tiny preset on the test text and run it, in the warm pool up to POOL_MAX_WORKERS
    ranks, else under torchrun; rank 0's result."""
    executor = pool if workers <= POOL_MAX_WORKERS else torchrun
    spec = parse_sweep({
        "name": "strategies", "model": {"preset": "tiny"}, "executor": "pool" if executor is pool else "torchrun",
        "data": {"source": "json", "path": str(alpaca_file), "tokenizer": str(model_dir), **data},
        "train": {**BASE_TRAIN, **train}, "resources": {"workers": workers, "timeout_s": 600},
    })
    (trial,) = plan(spec)
    return executor.execute(trial.payload)


def run_case(name: str, model_dir, alpaca_file) -> RankResult:
    """Run one named case once per session (equivalence tests reuse the results)."""
    if name not in _results:
        _results[name] = run_trial(*CASES[name], model_dir, alpaca_file)
    return _results[name]


# The partitioned strategies at 1 and 4 ranks repeat the 2-rank cases (fsdp2, zero3 against ddp) at another world
# size: they run with -m slow. tests/integration/sharded_values.py checks the sharded build's values at 4 ranks
# directly, faster. ddp-1rank stays: tensor parallelism is compared with it. TP x FSDP2 (4 ranks under torchrun on
# 2 CPUs, about 23 s) runs with -m slow too: the default run trains the same 2-D mesh on 4 real ranks in
# test_tp_lora_fsdp2.py, where its LoRA trial equals the unsplit model step for step.
OTHER_WORLD_SIZES = ("fsdp2-1rank", "zero3-1rank", "ddp-4ranks", "fsdp2-4ranks", "zero3-4ranks", "tp-fsdp2")


def _slow_if_other_world_size(name: str):
    return pytest.param(name, marks=pytest.mark.slow) if name in OTHER_WORLD_SIZES else name


@pytest.mark.parametrize("name", [_slow_if_other_world_size(name) for name in CASES])
def test_loss_goes_down(name, model_dir, alpaca_file):
    result = run_case(name, model_dir, alpaca_file)
    assert result.metrics.loss_final < result.metrics.loss_first - LEARNING_DROP, result
    assert result.provenance["world_size"] == CASES[name][2]


def test_fp16_matches_fp32(model_dir, alpaca_file):
    """The first step's forward has seen no update, so fp16 and fp32 differ only by fp16's rounding there.

    After it the runs part: the GradScaler skips any step whose fp16 gradients overflow, and Adam divides each
    gradient by its own running size, which magnifies rounding in small gradients. Later losses have no bound
    from fp16's precision, so both runs are held to learning (test_loss_goes_down), not to the same final loss.
    """
    fp32 = run_case("ddp-lora-sac-half", model_dir, alpaca_file)
    fp16 = run_case("ddp-lora-sac-half-fp16", model_dir, alpaca_file)
    assert fp16.metrics.loss_first == pytest.approx(fp32.metrics.loss_first, rel=FP16_RTOL)
    first = fp16.metrics.loss_first
    assert fp16.metrics.loss_final < first - first * FP16_RTOL - LEARNING_DROP, fp16


def test_compiled_blocks_report_their_graphs(model_dir, alpaca_file):
    """Every decoder block compiles in place: dynamo compiles graphs for them and the tiny Llama block breaks
    none (a break would split the block and fuse its halves apart)."""
    result = run_case("ddp-compile-ac-full-loaders2", model_dir, alpaca_file)
    assert result.metrics.compile_graphs >= 1 and result.metrics.compile_graph_breaks == 0, result
    assert result.metrics.compile_graph_break_reasons_json is None
    assert run_case("ddp", model_dir, alpaca_file).metrics.compile_graphs is None


@pytest.mark.parametrize("ddp_name, name", [
    ("ddp", "zero3"), pytest.param("ddp", "tp-fsdp2", marks=pytest.mark.slow), ("ddp", "fsdp2"),
    pytest.param("ddp-1rank", "fsdp2-1rank", marks=pytest.mark.slow),
    pytest.param("ddp-1rank", "zero3-1rank", marks=pytest.mark.slow),
    pytest.param("ddp-4ranks", "fsdp2-4ranks", marks=pytest.mark.slow),
    pytest.param("ddp-4ranks", "zero3-4ranks", marks=pytest.mark.slow)])
def test_partitioned_strategies_match_ddp(ddp_name, name, model_dir, alpaca_file):
    ddp, other = run_case(ddp_name, model_dir, alpaca_file), run_case(name, model_dir, alpaca_file)
    assert other.metrics.loss_first == pytest.approx(ddp.metrics.loss_first, abs=SAME_MATH_ABS)
    assert other.metrics.loss_final == pytest.approx(ddp.metrics.loss_final, abs=SAME_MATH_ABS)


def test_chunked_loss_trains_as_the_full_loss(model_dir, alpaca_file):
    """The same losses step by step: chunked and full give the same gradients to fp32 rounding
    (tests/unit/test_chunked_loss.py checks one step's exactly). fsdp2 (chunked), zero3 and tp (the full loss,
    their fallbacks) agree with ddp in the tests around."""
    chunked, full = run_case("ddp", model_dir, alpaca_file), run_case("ddp-full-loss", model_dir, alpaca_file)
    assert chunked.metrics.loss_first == pytest.approx(full.metrics.loss_first, abs=1e-5)
    assert chunked.metrics.loss_final == pytest.approx(full.metrics.loss_final, abs=SAME_MATH_ABS)


def test_tensor_parallel_matches_one_rank(model_dir, alpaca_file):
    # A TP group of 2 is one data-parallel replica: same batches as a single rank, same math, clipped alike.
    one, tp = run_case("ddp-1rank", model_dir, alpaca_file), run_case("tp", model_dir, alpaca_file)
    assert tp.metrics.tokens_per_step == one.metrics.tokens_per_step
    assert tp.metrics.loss_first == pytest.approx(one.metrics.loss_first, abs=SAME_MATH_ABS)
    assert tp.metrics.loss_final == pytest.approx(one.metrics.loss_final, abs=SAME_MATH_ABS)  # DTensor-aware clipping


def test_tensor_parallel_lora_trains_like_one_rank(model_dir, alpaca_file):
    # tests/integration/test_tp_lora.py checks one step's adapter gradients; this, the optimizer's steps on them (a
    # replicated adapter's gradient is a partial sum per rank until the optimizer and clipping reduce it).
    one, tp = run_case("ddp-1rank-lora", model_dir, alpaca_file), run_case("tp-lora", model_dir, alpaca_file)
    assert tp.metrics.params_trainable == one.metrics.params_trainable
    assert tp.metrics.params_total == one.metrics.params_total
    assert tp.metrics.loss_first == pytest.approx(one.metrics.loss_first, abs=SAME_MATH_ABS)
    assert tp.metrics.loss_final == pytest.approx(one.metrics.loss_final, abs=SAME_MATH_ABS)
    assert tp.metrics.loss_final < tp.metrics.loss_first - LEARNING_DROP


# The full matrix (slow): every strategy x AC variant x compile x LoRA/full, minus what plan rejects (ZeRO-3
# cannot compile). 104 trials, 5-40 s each on 2 cores (compile and ZeRO-3 the
# slowest): about 18 minutes.
MATRIX_STRATEGIES = {
    "ddp": ({"strategy": "ddp"}, 2), "fsdp2": ({"strategy": "fsdp2"}, 2),
    "zero1": ({"strategy": "deepspeed", "zero_stage": 1}, 2), "zero2": ({"strategy": "deepspeed", "zero_stage": 2}, 2),
    "zero3": ({"strategy": "deepspeed", "zero_stage": 3}, 2), "tp": ({"strategy": "tp", "tp_size": 2}, 2),
    "tp_fsdp2": ({"strategy": "tp_fsdp2", "tp_size": 2}, 4),
}
MATRIX_AC = {"ac0": {}, "sac-half": {"ac_ratio": "1/2"}, "ac-full": {"ac_ratio": "1"},
             "ac-op": {"ac_ratio": "1", "ac_mode": "op"}}


def _matrix():
    for (s_name, (strategy, workers)), (ac_name, ac), compiled, finetune in itertools.product(
            MATRIX_STRATEGIES.items(), MATRIX_AC.items(), (False, True), ("full", "lora")):
        if compiled and s_name == "zero3":
            continue
        train = {**strategy, **ac, "compile": compiled, "finetune": finetune}
        yield pytest.param(train, workers, id=f"{s_name}-{ac_name}-{'compile' if compiled else 'eager'}-{finetune}")


@pytest.mark.slow
@pytest.mark.parametrize("train, workers", list(_matrix()))
def test_full_matrix_trains(train, workers, model_dir, alpaca_file):
    if train["finetune"] == "lora":
        train = {**train, "lr": 1e-2}  # adapters start at zero: a higher rate shows learning within 8 steps
    result = run_trial(train, {}, workers, model_dir, alpaca_file)
    assert result.metrics.loss_final < result.metrics.loss_first - LEARNING_DROP, result
