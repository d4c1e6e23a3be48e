"""The warm pool executor on a real local Ray: reuse, failure isolation, recycling, live progress."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import ray

from raybench.drivers.executors import RAY_WORKER_ENV
from raybench.drivers.executors.pool import manager
from raybench.drivers.progress import SweepProgress
from raybench.drivers.ray_cluster import ray_cluster
from raybench.drivers.sweep import run_planned
from raybench.planning.plan import plan
from raybench.results import store
from raybench.spec.load import parse_sweep

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster():
    with ray_cluster(None):
        yield


def pool_sweep(name: str, axes: dict, **extra):
    return parse_sweep({"name": name, "model": {"preset": "tiny"}, "executor": "pool",
                        "train": {"steps": 6, "warmup_steps": 1, "seq_len": 32, "precision": "fp32"},
                        "resources": {"workers": 2}, "axes": axes, **extra})


def run(spec, store_dir):
    run_planned(plan(spec), spec.name, str(store_dir), "pool", progress=lambda line: None)
    return store.read_results(store_dir, spec.name).sort_values("ended_at")


def groups():
    return ray.get(manager().groups_info.remote())


def ray_worker_overhead_gib() -> float:
    """Resident memory a Ray worker process adds to the same imports as a plain process: its core worker, and
    the libraries Ray itself loads in every worker (pyarrow, for its data serializers, when installed). A pool
    actor is such a process, so the warm rows keep it by design (docs/executors.md); a torchrun rank has none."""
    class Probe:  # defined here: shipped to the worker by value
        def rss_gib(self) -> float:
            import peft  # noqa: F401  (a pool actor imports it when it starts)

            from raybench.runtime import rank_memory, worker  # noqa: F401  (a pool actor's start-up imports)

            return rank_memory.current_host_memory_gib()

    script = ("import peft; from raybench.runtime import rank_memory, worker; "
              "print(rank_memory.current_host_memory_gib())")
    plain = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    probe = ray.remote(num_cpus=0)(Probe).options(runtime_env={"env_vars": RAY_WORKER_ENV}).remote()
    try:
        in_ray = ray.get(probe.rss_gib.remote())
    finally:
        ray.kill(probe)
    return in_ray - float(plain.stdout.split()[-1])


def test_pool_reuses_one_group_across_trials_and_sweeps(cluster, tmp_path):
    rows = run(pool_sweep("pool-a", {"train.strategy": ["ddp", "fsdp2"], "train.micro_batch": [1, 2]}), tmp_path)
    assert list(rows.status) == ["ok"] * 4 and set(rows.executor) == {"pool"}
    # The warm actors kept the preset's weights: only the first trial initialised them.
    assert list(rows.weights_cache) == ["miss", "hit", "hit", "hit"]
    first = groups()
    assert len(first) == 1 and first[0]["trials_run"] == 4
    rows = run(pool_sweep("pool-b", {"train.micro_batch": [3]}), tmp_path)  # a second sweep: same warm actors
    assert list(rows.status) == ["ok"]
    assert [(g["id"], g["trials_run"]) for g in groups()] == [(first[0]["id"], 5)]


def test_tune_callback_reports_dashboard_starts_and_results(cluster, tmp_path):
    spec = pool_sweep("progress", {"train.micro_batch": [1, 2]})
    trials = plan(spec)
    lines: list[str] = []
    progress = SweepProgress("lines", write=lines.append)
    run_planned(trials, spec.name, str(tmp_path), "pool", progress=progress)
    assert lines[0].startswith("Ray dashboard: http://127.0.0.1:")
    assert sorted(line.split()[0] for line in lines[1:]) == ["[1/2]", "[2/2]"]
    assert set(progress.states) == {t.trial_id for t in trials}
    for state in progress.states.values():
        assert state.status == "ok" and state.label.startswith("micro_batch=")
        assert state.tok_per_s_per_device > 0 and state.peak_gib > 0  # host RSS on CPU
        assert state.ended_s > state.started_s  # on_trial_start was seen before the result


def test_failed_trial_keeps_group_usable(cluster, tmp_path, model_dir):
    one_record = tmp_path / "one.jsonl"
    one_record.write_text(json.dumps({"instruction": "say hi", "input": "", "output": "the fox " * 150}) + "\n")
    before = {g["id"] for g in groups()}
    # Text for one 256-token row (the driver lays it out before launch), too little for a micro-batch on each of
    # two ranks: every rank fails while loading data, after the group formed.
    bad = parse_sweep({"name": "pool-fail", "model": {"path": str(model_dir)}, "executor": "pool",
                       "data": {"source": "json", "path": str(one_record)},
                       "train": {"steps": 6, "warmup_steps": 1, "seq_len": 256, "precision": "fp32"},
                       "resources": {"workers": 2}})
    rows = run(bad, tmp_path)
    assert list(rows.status) == ["error"] and "fewer than one micro-batch per rank" in rows.message.iloc[0]
    # The failing rank's own traceback, for debugging later: its frames down to the raise in raybench.runtime.data.
    assert 'raybench/runtime/data.py", line' in rows.error_detail.iloc[0] and "\x1b" not in rows.error_detail.iloc[0]
    rows = run(pool_sweep("pool-after-fail", {"train.lr": [1e-4]}), tmp_path)
    assert list(rows.status) == ["ok"]
    assert {g["id"] for g in groups()} == before  # the same group served the failing and the next trial


def test_killed_actor_gives_error_row_and_group_is_rebuilt(cluster, tmp_path):
    before = {g["id"] for g in groups()}
    # A long trial, whose rank 1 is killed, then a short one on the rebuilt group.
    spec = pool_sweep("pool-kill", {"train.steps": [400, 6]}, train={"warmup_steps": 1, "seq_len": 32,
                                                                    "precision": "fp32"})
    killed = []

    def kill_rank_one():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not killed:
            busy = [g for g in groups() if g["busy"]]
            if busy:
                time.sleep(3)  # let the trial get into its loop
                pid = ray.get(busy[0]["actors"][1].pid.remote())
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.2)

    killer = threading.Thread(target=kill_rank_one)
    killer.start()
    rows = run(spec, tmp_path)
    killer.join()
    assert killed
    assert sorted(rows.status) == ["error", "ok"]
    assert "died" in rows[rows.status == "error"].message.iloc[0].lower()
    assert not before & {g["id"] for g in groups()}  # the broken group was replaced


def test_groups_recycle_after_configured_trials(cluster, tmp_path):
    spec = pool_sweep("pool-recycle", {"train.micro_batch": [1, 2, 3]}, pool={"recycle_after_trials": 2})
    ids_before = {g["id"] for g in groups()}
    rows = run(spec, tmp_path)
    assert list(rows.status) == ["ok"] * 3
    now = groups()
    # Earlier groups had served >= 2 trials, so they were replaced; a group is dropped on its 2nd trial.
    assert not ids_before & {g["id"] for g in now}
    assert all(g["trials_run"] < 2 for g in now)


def test_other_executors_get_the_pools_idle_resources(cluster, tmp_path):
    # The warm group's trial: LoRA under tensor parallelism, with dropout (every rank of the TP group draws the
    # same masks, strategies/tp.py).
    tp_lora = {"train.strategy": "tp", "train.tp_size": 2, "train.finetune": "lora", "train.lora.dropout": 0.1}
    rows = run(pool_sweep("pool-before-train", {"setup": [tp_lora]}), tmp_path)
    assert list(rows.status) == ["ok"], list(rows.message)
    assert groups()  # a warm group holds the 2 CPUs of this machine
    spec = parse_sweep({"name": "train-after-pool", "model": {"preset": "tiny"}, "executor": "torchrun",
                        "train": {"steps": 4, "warmup_steps": 1, "seq_len": 32, "precision": "fp32"},
                        "resources": {"workers": 2, "timeout_s": 120}})
    run_planned(plan(spec), spec.name, str(tmp_path), "torchrun", progress=lambda line: None)
    assert list(store.read_results(tmp_path, spec.name).status) == ["ok"]
    assert groups() == []


@pytest.fixture(scope="module")
def deepspeed_rows(cluster, tmp_path_factory):
    """A ZeRO-2 then a ZeRO-3 trial in one warm DeepSpeed group, run once for the two tests below (a DeepSpeed
    group costs its own actors' start, and ZeRO-3 is the slowest CPU trial): their rows, and the warm groups
    left once the ZeRO-3 trial (which patches F.linear for its whole process) ended."""
    spec = parse_sweep({"name": "pool-ds", "model": {"preset": "tiny"}, "executor": "pool",
                        "train": {"strategy": "deepspeed", "steps": 4, "warmup_steps": 1, "seq_len": 32,
                                  "precision": "fp32"},
                        "resources": {"workers": 2}, "axes": {"train.zero_stage": [2, 3]}})
    rows = run(spec, tmp_path_factory.mktemp("pool-ds"))
    return rows, groups()


def test_deepspeed_zero3_after_zero2_in_one_warm_group(deepspeed_rows):
    # DeepSpeed caches the world group it saw first; ZeRO-3 on a later trial in the same process must not reuse
    # the group an earlier trial destroyed (found on GPU: "Group ... is not registered").
    rows, _ = deepspeed_rows
    assert list(rows.status) == ["ok", "ok"], list(rows.message)
    # ... in the same processes: importing DeepSpeed is not the ZeRO-2 trial's change, so its group stays.
    assert list(rows.process_trial_index) == [rows.process_trial_index.iloc[0], rows.process_trial_index.iloc[0] + 1]


def test_a_trial_that_patches_globals_gets_them_restored_and_its_group_replaced(cluster, tmp_path, deepspeed_rows):
    # DeepSpeed ZeRO-3 replaces torch.nn.functional.linear for its whole process; a plain trial changes nothing.
    plain = run(pool_sweep("pool-plain", {"train.micro_batch": [1, 2]}), tmp_path)
    first, second = sorted(plain.process_trial_index)
    assert second == first + 1  # one group ran both: the first trial changed nothing, its group stayed
    # The ZeRO-3 trial: the last of deepspeed_rows, in the group that had run ZeRO-2 just before.
    rows, groups_after = deepspeed_rows
    assert list(rows.train_zero_stage) == [2, 3] and rows.status.iloc[-1] == "ok", list(rows.message)
    for seen in (groups_after, groups()):  # right after that trial, and still now
        deepspeed_groups = [g for g in seen if dict(g["shape"][-1]).get("DS_ACCELERATOR") == "cpu"]
        assert deepspeed_groups == []  # replaced after the trial that patched F.linear


def _compiled_and_eager_shared_the_group(rows, compile_cache):
    """Neither the compile cache's variables nor what compiling sets ended the group: each trial had the
    environment a fresh process would have had (the store's compile cache when compiling, else inductor's default,
    which importing inductor sets in any process), and the second compiled trial compiled what the first did
    (dynamo reset between them), with no graph break in the tiny Llama blocks; eager trials report none."""
    cache_dirs = {r.train_compile: json.loads(r.env_json).get("TORCHINDUCTOR_CACHE_DIR") for r in rows.itertuples()}
    assert cache_dirs[True] == str(compile_cache) and cache_dirs[False] != cache_dirs[True]
    compiled = [(r.compile_graphs, r.compile_graph_breaks) for r in rows.itertuples() if r.train_compile]
    assert len(compiled) == 2 and compiled[0] == compiled[1] and compiled[0][0] >= 1 and compiled[0][1] == 0, compiled
    assert rows.loc[~rows.train_compile, "compile_graphs"].isna().all()


def test_warm_trial_equals_fresh_after_other_trials(cluster, tmp_path):
    """The same trial fresh (torchrun) and as a later trial of a pool group that first ran other kinds, compiled
    and eager among them."""
    base = {"steps": 6, "warmup_steps": 1, "seq_len": 32, "precision": "fp32"}
    # LoRA dropout draws from the global generator, which a warm actor's earlier trials have advanced.
    target = {"strategy": "fsdp2", "ac_ratio": "1/2", "finetune": "lora", "lora.dropout": 0.1}
    # Kinds that share the target's group (a DeepSpeed trial would run in a group of its own: another shape).
    before = [{"compile": True}, {"compile": True, "lr": 1e-4}, {"finetune": "lora"}, {"micro_batch": 2}]
    spec = parse_sweep({"name": "warm-fresh", "model": {"preset": "tiny"}, "executor": "pool", "train": base,
                        "resources": {"workers": 2},
                        "axes": {"setup": [{f"train.{k}": v for k, v in t.items()} for t in [*before, target]]}})
    trials = plan(spec)
    run_planned(trials, spec.name, str(tmp_path / "warm"), "pool", progress=lambda line: None)
    warm = store.read_results(tmp_path / "warm", spec.name).set_index("trial_id").loc[trials[-1].trial_id]
    run_planned(trials[-1:], spec.name, str(tmp_path / "fresh"), "torchrun", progress=lambda line: None)
    fresh = store.read_results(tmp_path / "fresh", spec.name).iloc[0]
    assert warm.status == fresh.status == "ok"
    # The target ran in the processes that had just run every earlier trial.
    first = store.read_results(tmp_path / "warm", spec.name).process_trial_index.min()
    assert warm.process_trial_index == first + len(before) and fresh.process_trial_index == 0
    for column in ("loss_first", "loss_final", "params_total", "flops_per_token"):
        assert warm[column] == fresh[column], column
    warm_rows = store.read_results(tmp_path / "warm", spec.name)
    _compiled_and_eager_shared_the_group(warm_rows, tmp_path / "warm" / "_cache" / "compile")
    # Training's own host memory: the peak above the RSS just before the build, per rank.
    growth = [[p - b for p, b in zip(row.peak_rss_gib_by_rank, row.rss_before_build_gib_by_rank)]
              for row in (warm, fresh)]
    assert max(growth[0]) == pytest.approx(max(growth[1]), rel=0.10, abs=0.02), growth
    # The warm actors hold the preset's weights between trials; the row's host figures are net of them.
    assert warm.host_held_gib > 0 and fresh.host_held_gib == 0
    # What stays in them is the Ray worker process itself, which a torchrun rank is not (docs/executors.md):
    # measured here, since it depends on what Ray loads in every worker and on what the runtime imports.
    ray_worker = ray_worker_overhead_gib()
    assert 0 < ray_worker < 0.25, ray_worker
    assert warm.peak_rss_gib - ray_worker == pytest.approx(fresh.peak_rss_gib, rel=0.10), (
        warm.peak_rss_gib, ray_worker, fresh.peak_rss_gib)


def test_real_chat_data_tokenized_once_packed_and_padded(cluster, tmp_path, model_dir, chat_file, chat_tokenizer,
                                                         chat_tokens):
    """The shipped CPU chat sweep (sweeps/chat-cpu.yaml) on data made here: one tokenization serves the packed and
    the padded trial, a later sweep finds it in the store, and the rows' token counts match a count of the data
    made without raybench."""
    from pathlib import Path

    import yaml

    from raybench.drivers.api import run_sweep

    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "sweeps" / "chat-cpu.yaml").read_text())
    raw["model"]["path"] = str(model_dir)
    raw["data"].update(path=str(chat_file), tokenizer=str(chat_tokenizer))
    seq_len, per_step = raw["train"]["seq_len"], raw["resources"]["workers"] * raw["train"]["micro_batch"]
    lengths = [min(len(ids), seq_len) for ids, _ in chat_tokens]
    packed_rows, used = 0, seq_len
    for n in lengths:  # whole conversations side by side, a new row when the next one does not fit
        packed_rows, used = (packed_rows + 1, n) if used + n > seq_len else (packed_rows, used + n)
    # Each trial runs one epoch, every step timed, so every token of the data is counted exactly once.
    assert packed_rows % per_step == 0 and len(lengths) % per_step == 0 and packed_rows < len(lengths)
    raw["train"]["warmup_steps"] = 0
    raw["axes"] = {"layout": [{"data.packing": True, "train.steps": packed_rows // per_step},
                              {"data.packing": False, "train.steps": len(lengths) // per_step}]}
    run_sweep(parse_sweep(raw), store_path=str(tmp_path), progress=lambda line: None)
    rows = store.read_results(tmp_path, "chat-cpu").set_index("data_packing")
    assert list(rows.status) == ["ok", "ok"] and set(rows.world_size) == {2}
    assert set(rows.data_cache) == {"build"} and rows.data_cache_key.nunique() == 1 and rows.data_build_s.min() > 0
    assert set(rows.dataset_name) == {"chat.jsonl"} and set(rows.data_samples) == {len(chat_tokens)}
    counts = [len(ids) for ids, _ in chat_tokens]
    assert set(rows.sample_tokens_max) == {max(counts)}
    assert rows.sample_tokens_mean.tolist() == pytest.approx([sum(counts) / len(counts)] * 2)
    for packing, layout_rows in ((True, packed_rows), (False, len(lengths))):
        row = rows.loc[packing]
        assert row.tokens_per_step == per_step * seq_len
        assert row.nonpad_tokens_per_step * row.steps_timed == sum(lengths)
        assert row.packing_efficiency == pytest.approx(sum(lengths) / (layout_rows * seq_len))
        assert row.nonpad_tok_per_s / row.tok_per_s == pytest.approx(row.packing_efficiency)
        assert row.loss_first == row.loss_first and row.loss_final == row.loss_final  # not NaN
    # A later sweep on the same data and tokenizer tokenizes nothing.
    raw.update(name="chat-cpu-again", axes={"data.packing": [True]})
    run_sweep(parse_sweep(raw), store_path=str(tmp_path), progress=lambda line: None)
    again = store.read_results(tmp_path, "chat-cpu-again").iloc[0]
    assert again.status == "ok" and again.data_cache == "hit" and again.data_build_s != again.data_build_s
    assert again.data_cache_key == rows.data_cache_key.iloc[0]


# Last: its first trial runs in the group the test before left (the tiny preset on 2 workers); its second starts
# a group of its own, which no later test can use (a group's start is most of a short trial's time).
def test_train_env_starts_its_own_group(cluster, tmp_path):
    # NCCL reads NCCL_* once per process: such a variable takes effect only in actors started with it.
    spec = pool_sweep("pool-env", {"train.env": [{}, {"NCCL_BUFFSIZE": "4194304"}]})
    rows = run(spec, tmp_path)
    assert list(rows.status) == ["ok", "ok"]
    envs = [json.loads(e) for e in rows.env_json]
    assert "NCCL_BUFFSIZE" not in envs[0] and envs[1]["NCCL_BUFFSIZE"] == "4194304"  # what was in effect
    shapes = [g["shape"] for g in groups()]
    assert any(dict(shape[-1]).get("NCCL_BUFFSIZE") == "4194304" for shape in shapes)


def test_a_trial_larger_than_the_cluster_ends_at_once_with_not_enough_nodes(cluster, tmp_path):
    cpus = int(ray.cluster_resources()["CPU"])
    spec = pool_sweep("pool-too-big", {"train.lr": [1e-4]}, resources={"workers": cpus + 1, "timeout_s": 600})
    rows = run(spec, tmp_path)
    assert list(rows.status) == ["error"] and "not enough nodes" in rows.message.iloc[0], rows.message.iloc[0]
    assert rows.trial_wall_s.iloc[0] < 600  # ended at the check, not at its timeout


# After the tests that reuse the tiny group: this one drains the pool's idle groups.
def test_a_lease_given_up_at_its_timeout_leaves_no_placement_group_behind(cluster, tmp_path):
    cpus = int(ray.cluster_resources()["CPU"])
    class Holder:  # defined here: shipped to the worker by value
        def ready(self) -> bool:
            return True

    ray.get(manager().drain_idle.remote())
    holder = ray.remote(num_cpus=1)(Holder).remote()
    ray.get(holder.ready.remote())
    spec = pool_sweep("pool-lease-timeout", {"train.lr": [1e-4]}, resources={"workers": cpus, "timeout_s": 5})
    rows = run(spec, tmp_path)
    assert list(rows.status) == ["timeout"], rows.message.iloc[0]
    assert "while its pool group waited for resources" in rows.message.iloc[0]
    ray.kill(holder)
    # The given-up lease's placement group was removed: the freed CPU stays free (it would take every CPU).
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < cpus and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(2)
    assert ray.available_resources().get("CPU", 0) == cpus
    assert not [g for g in groups() if g["busy"]]
