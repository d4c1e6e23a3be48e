"""The rehearsal against real ranks: a fake rank's tensor memory by category matches the same trial's step run for
real on 1 and 2 gloo processes (the tiny shapes of tests/rehearse_cases.py), within MEMORY_TOLERANCE."""

from __future__ import annotations

import multiprocessing as mp
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from raybench.runtime.strategies import RankContext

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rehearse_cases import MEMORY_TOLERANCE, REAL_CASES, fake_trace, real_trace, tiny_trial  # noqa: E402

pytestmark = pytest.mark.integration


def _real_rank(rank: int, world: int, init_file: str, out, cases: list[str]) -> None:
    """One real gloo rank running the named cases of REAL_CASES; rank 0 reports its figures."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    results = {}
    for name in cases:
        trial = tiny_trial(world, **REAL_CASES[name])
        step = real_trace(trial, RankContext(rank, world, 0, torch.device("cpu")))
        results[name] = {"memory_gib": step.memory_gib, "resident_gib": step.resident_gib}
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> dict:
    """The same steps, for real, on 1 and on 2 gloo processes with real tensors: {world: {case: rank 0's}}.

    Every case on 2 ranks; on 1 rank only fsdp2, the one case the tests read at both world sizes."""
    ctx = mp.get_context("spawn")
    results = {}
    for world, cases in ((1, ["fsdp2"]), (2, list(REAL_CASES))):
        out = ctx.Queue()
        init = tmp_path_factory.mktemp(f"gloo{world}") / "init"
        procs = [ctx.Process(target=_real_rank, args=(r, world, str(init), out, cases)) for r in range(world)]
        for p in procs:
            p.start()
        results[world] = out.get(timeout=300)
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    return results


def assert_close(rehearsed: float, real: float, what: str) -> None:
    assert abs(rehearsed - real) <= MEMORY_TOLERANCE * real + 1e-6, f"{what}: rehearsed {rehearsed}, real {real}"


@pytest.mark.parametrize("case", list(REAL_CASES))
def test_fake_rank_matches_real_gloo_ranks(case, real):
    """World size 2: the fake rank's tensor memory by category is the real rank 0's, within 10%."""
    fake = fake_trace(tiny_trial(2, **REAL_CASES[case]))
    measured = real[2][case]
    for category in ("parameters", "gradients", "optimizer_state", "activations"):
        assert_close(fake.memory_gib[category], measured["memory_gib"][category], f"peak {category}")
    for category, real_gib in measured["resident_gib"].items():
        assert_close(fake.resident_gib[category], real_gib, f"resident {category}")
    assert_close(fake.peak_gib, sum(measured["memory_gib"].values()), "peak")


@pytest.mark.parametrize("world", [1, 2, 8])
def test_fake_world_sizes_shard_as_real_ranks_do(world, real):
    """World sizes 1, 2 and 8 (fake) against the real 1- and 2-rank runs: FSDP2 shards parameters and optimizer
    state evenly (the tiny shapes divide by 8), so a rank of `world` holds real_ranks/world of a real rank's."""
    fake = fake_trace(tiny_trial(world, strategy="fsdp2")).resident_gib
    for real_world in (1, 2):
        measured = real[real_world]["fsdp2"]["resident_gib"]
        for category in ("parameters", "optimizer_state"):
            assert_close(fake[category], measured[category] * real_world / world,
                         f"world {world} vs real {real_world}: {category}")


@pytest.mark.parametrize("world", [1, 2, 8])
def test_ddp_ranks_hold_a_whole_replica_at_every_world_size(world, real):
    """DDP replicates: a fake rank of any world holds what a real rank of 2 holds, and its step all-reduces
    every trainable gradient once (fp32 gradients: autocast keeps fp32 parameters). One rank runs without DDP
    (nothing to all-reduce): the same, less the reducer's bucket copy of every gradient, and no all-reduce."""
    for case in ("ddp", "ddp-lora"):
        trial = tiny_trial(world, **REAL_CASES[case])
        fake = fake_trace(trial)
        for category, real_gib in real[2][case]["resident_gib"].items():
            assert_close(fake.resident_gib[category], real_gib, f"{case} world {world}: resident {category}")
        gradient_bytes = 4 * trial.assessment.analytic.params_trainable
        buckets_gib = 0 if world == 1 else gradient_bytes / 2**30
        real_peak_gib = sum(real[2][case]["memory_gib"].values()) - gradient_bytes / 2**30 + buckets_gib
        assert_close(fake.peak_gib, real_peak_gib, f"{case} world {world}: peak")
        assert fake.comm_bytes.get("allreduce", 0) == (0 if world == 1 else gradient_bytes)
        assert fake.overlapped_comm == (() if world == 1 else ("allreduce",))
