"""A lost Ray node as raybench reads it (no Ray here: tests/integration/test_cluster_faults.py kills one for real):
the node table, whether a trial still fits, the row's status and message, `cluster status`'s lines, the template's
settings, and the `interrupted` status."""

from __future__ import annotations

from pathlib import Path

from raybench.cli.cluster import status_text as cluster_status_text
from raybench.drivers import nodes
from raybench.drivers.slurm import HOLD_PAYLOAD, SlurmOptions, render
from raybench.drivers.trial import STATUSES, classify

ALIVE = {"NodeID": "a" * 56, "Alive": True, "NodeManagerAddress": "10.0.0.1", "Labels": {"slurm_node": "gpu01"},
         "Resources": {"CPU": 8.0, "GPU": 4.0}}
DEAD = {"NodeID": "b" * 56, "Alive": False, "NodeManagerAddress": "10.0.0.2", "Labels": {"slurm_node": "gpu02"},
        "Resources": {}, "DeathReason": 1,
        "DeathReasonMessage": "health check failed due to missing too many heartbeats"}


def test_a_dead_node_is_named_by_its_slurm_node_with_rays_reason():
    node = nodes.from_ray(DEAD)
    assert not node.alive and node.name == "gpu02"
    assert node.describe() == "gpu02 (10.0.0.2), Ray node bbbbbbbb: health check failed due to missing too many heartbeats"
    plain = nodes.from_ray({**ALIVE, "Labels": {}})  # a cluster raybench did not label: Ray's name, its IP
    assert plain.name == "10.0.0.1" and plain.describe() == f"10.0.0.1, Ray node {'a' * 8}" and plain.cause == ""


def test_a_trial_that_needs_more_nodes_than_remain_says_not_enough_nodes():
    table = [nodes.from_ray(ALIVE), nodes.from_ray(DEAD)]
    assert nodes.shortfall(2, 4, 0, table) is None  # two 4-CPU workers fit on the 8-CPU node
    why = nodes.shortfall(2, 8, 0, table)
    assert why.startswith("not enough nodes: the trial needs 2 worker(s) of 8 CPU; the 1 alive Ray node(s) hold 1")
    assert "lost: gpu02 (10.0.0.2)" in why and "missing too many heartbeats" in why
    assert nodes.shortfall(5, 1, 1, table).endswith("run the sweep again once the cluster has its nodes back")
    assert nodes.workers_that_fit([nodes.from_ray(ALIVE)], 1, 1) == 4  # GPUs bound it, not the 8 CPUs


def test_lost_since_lists_only_nodes_alive_at_the_start():
    table = [nodes.from_ray(ALIVE), nodes.from_ray(DEAD)]
    assert nodes.lost_since({"b" * 56, "a" * 56}, table) == [table[1]]
    assert nodes.lost_since({"a" * 56}, table) == []
    # One node (an embedded Ray: the driver's own) or an ordinary error: no wait for a death to be declared.
    assert nodes.lost_during("WorkerCrashedError: died", {"a" * 56}) == []
    assert nodes.lost_during("ValueError: bad value", {"a" * 56, "b" * 56}) == []
    # A worker killed while its group starts fails the trial with Train's ControllerError: that one waits.
    assert any(m in "ray.train.ControllerError: Training failed due to controller error: At least one of the "
               "worker actors failed to initialize" for m in nodes.LOST_PROCESS_MARKERS)


def test_a_lost_node_is_an_error_row_whose_message_names_it():
    failure = "WorkerCrashedError: The worker died unexpectedly. Some common causes include OOM"
    err = nodes.NodeLost(nodes.lost_message([nodes.from_ray(DEAD)], failure))
    status, message = classify(err)
    assert status == "error"  # not oom: Ray's guesses after the node's name decide nothing
    assert message.startswith("Ray node gpu02 (10.0.0.2), Ray node bbbbbbbb: health check failed")
    assert classify(nodes.NotEnoughNodes("not enough nodes: x"))[0] == "error"


def test_cluster_status_names_the_node_that_is_gone():
    status = {"name": "two", "job_id": "7", "state": "RUNNING", "address": "10.0.0.1:6379",
              "nodes": [vars(nodes.from_ray(ALIVE)), vars(nodes.from_ray(DEAD))]}
    text = cluster_status_text(status)
    assert "node gpu01 (10.0.0.1): alive" in text
    assert "node gpu02 (10.0.0.2): GONE (health check failed due to missing too many heartbeats)" in text
    assert "degraded" in text
    healthy = cluster_status_text({**status, "nodes": [vars(nodes.from_ray(ALIVE))]})
    assert "degraded" not in healthy and "GONE" not in healthy


def test_script_keeps_the_cluster_up_when_a_worker_node_is_lost(tmp_path: Path):
    text = render(SlurmOptions(nodes=2), tmp_path, HOLD_PAYLOAD)
    assert "#SBATCH --no-kill" in text.splitlines()  # SLURM does not end the job for a failed node
    assert '--labels="slurm_node=$SLURMD_NODENAME"' in text
    assert "RAY_health_check_period_ms=1000" in text
    assert 'wait "${step_pids[0]}"' in HOLD_PAYLOAD  # only the head's step ending takes the cluster down


def test_interrupted_is_a_status():
    assert "interrupted" in STATUSES
