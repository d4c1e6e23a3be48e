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


# torchrun's output when rank 1 aborts after training (a C++ thread left running: "terminate called without an
# active exception", exit -6), as the executors read it: each progress-bar redraw ("\r") a line of its own.
_BAR = "".join(f"\r{p:3d}%|{'#' * (p // 20):<5}| {p // 20}/5 [00:0{p // 20}<00:00, 4.2it/s, loss=1.23]"
               for p in (20, 40, 60, 80, 100))
SIGNAL_LOG = f"""{_BAR}
terminate called without an active exception
{_BAR}
[rank0]: Traceback (most recent call last):
[rank0]:     work.wait()
[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:57484.
W1127 22:28:05.736000 8399 torch/distributed/elastic/api.py:1028] Sending process 8464 closing signal SIGTERM
E1127 22:28:05.751000 8399 torch/distributed/elastic/api.py:1002] failed (exitcode: -6) local_rank: 1 (pid: 8465)
Traceback (most recent call last):
  File "torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
======================================================
train.py FAILED
------------------------------------------------------
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 8464)  (SIGTERM)
  traceback : Signal 15 (SIGTERM) received by PID 8464
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-27_22:28:05
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 8465)  (SIGABRT)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 8465
======================================================
"""
SIGNAL_MESSAGE = ("rank 1 was killed by signal SIGABRT (exit code -6); its last error line: terminate called "
                  "without an active exception")


def test_a_rank_killed_by_a_signal_is_named_with_the_signal_and_its_last_error_line():
    from raybench.drivers.executors import command, torchrun

    # Followed by the bar's fragments, rank 0's error in its wake and its SIGTERM, none of which is the message.
    text = command._failure_text(["python", "-m", "torch.distributed.run"], 1, SIGNAL_LOG + _BAR)
    assert classify(RuntimeError(text)) == ("error", SIGNAL_MESSAGE)
    assert classify(RuntimeError(torchrun._failure_text(1, SIGNAL_LOG))) == ("error", SIGNAL_MESSAGE)


def test_a_rank_that_raised_then_aborted_is_named_by_its_exception():
    """A refused host allocation raises in the rank, which then aborts on its way out (-6): the exception is the
    cause, and the row is an oom."""
    from raybench.drivers.executors import torchrun

    raised = SIGNAL_LOG.replace("terminate called without an active exception",
                                "[rank1]: RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: "
                                "can't allocate memory: you tried to allocate 1073741824 bytes.\n"
                                "terminate called without an active exception")
    status, message = classify(RuntimeError(torchrun._failure_text(1, raised)))
    assert status == "oom" and message.startswith("RuntimeError: [enforce fail at alloc_cpu.cpp:117]"), message
    assert message.endswith("bytes. (rank 1 raised it, then was killed by signal SIGABRT on its way out: exit code "
                            "-6)"), message


def test_a_command_killed_by_a_signal_itself_is_named_so():
    from raybench.drivers.executors import command

    text = command._failure_text(["python", "train.py"], -9, f"step 1\n{_BAR}\n")
    assert classify(RuntimeError(text)) == (
        "error", "the command python was killed by signal SIGKILL (exit code -9); its last output line: step 1")
