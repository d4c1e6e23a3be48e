"""A failed trial's status and one-line message, from the error texts real runs produced."""

from __future__ import annotations

from raybench.drivers.trial import classify

# Ray Train 2.60's text for a worker killed mid-training (shortened), and for one killed while its group started.
WORKER_ERRORS = """Traceback (most recent call last):
  File "raybench/drivers/executors/train.py", line 62, in _fit
    raise result.error
ray.train.WorkerGroupError: Training failed due to worker errors:
[Rank 0 Error Snippet]:
A worker health check failed.
The actor died unexpectedly before finishing this task.
The actor is dead because its worker process has died. Some common causes include: (1) the process was killed
by the OOM killer due to high memory usage"""
CONTROLLER_ERROR = """ray::_fit() (pid=3446, ip=192.0.2.2)
  File "raybench/drivers/executors/train.py", line 62, in _fit
    result = trainer.fit()
ray.train.ControllerError: Training failed due to controller error:
At least one of the worker actors failed to initialize."""


def test_a_heading_line_carries_the_reason_that_follows_it():
    assert classify(RuntimeError(WORKER_ERRORS)) == (
        "error", "ray.train.WorkerGroupError: Training failed due to worker errors: A worker health check failed.")
    assert classify(RuntimeError(CONTROLLER_ERROR)) == (
        "error", "ray.train.ControllerError: Training failed due to controller error: At least one of the worker "
                 "actors failed to initialize.")


def test_rays_guesses_about_a_dead_worker_do_not_make_it_an_oom():
    assert classify(RuntimeError(WORKER_ERRORS))[0] == "error"
    assert classify(RuntimeError("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"))[0] == "oom"


def test_a_line_without_a_heading_is_kept_as_it_is():
    assert classify(ValueError("bad shape"))[1] == "ValueError: bad shape"
    assert classify(TimeoutError("trial exceeded resources.timeout_s=5 s"))[0] == "timeout"


# torchrun's log of a compiled trial whose ranks hit dynamo's recompile limit (shortened).
RECOMPILE_LIMIT_LOG = """[rank0]:   File "torch/_dynamo/convert_frame.py", line 2027, in _compile
[rank0]:     raise FailOnRecompileLimitHit(
[rank0]: torch._dynamo.exc.FailOnRecompileLimitHit: Hard failure due to fail_on_recompile_limit_hit
E1126 08:07:31.131000 16883 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0
Traceback (most recent call last):
  File "torch/distributed/run.py", line 1032, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
raybench.runtime.worker FAILED
Explanation: not an exception"""


def test_a_qualified_exception_of_any_name_is_the_message():
    from raybench.drivers.executors.torchrun import _failure_text

    assert _failure_text(1, RECOMPILE_LIMIT_LOG).splitlines()[0] == (
        "torchrun exited 1: torch._dynamo.exc.FailOnRecompileLimitHit: Hard failure due to "
        "fail_on_recompile_limit_hit")
