"""torchtitan's own trainer, run by torchtitan's own code, its optimizer steps timed by raybench's probe.

Runs inside torchtitan's environment (stack.python), under torchrun, one process per rank:

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        -m raybench.runtime.stacks.torchtitan_train my_jobs.py my_job --training.local_batch_size 4 ...

It loads the job config file (a Python file of config functions, as torchtitan's own `config_registry.py` files are)
as a module and calls torchtitan's `train.main()` with `--module <that module> --config <function>` and the
overrides, so torchtitan's ConfigManager (tyro) parses and checks them, sets up the process group, builds the
trainer and trains exactly as `torchtitan.train` does alone. The Trainer class gets three wrappers, each calling
torchtitan's own method:

- tokens: `batch_generator` counts each micro-batch as the training step draws it, `labels.numel()` and
  `labels != IGNORE_INDEX` (the count torchtitan normalizes its loss by);
- loss: `forward_backward_step` returns this rank's loss sum over the global valid-token count; times that count it
  is the rank's loss sum, so each rank records its token-weighted mean over the step without an extra collective
  (under pipeline parallelism only the last stage has a loss: not recorded);
- the step's end: `train` wraps the trainer's optimizers' `step()` to close one probe step per optimizer step, with
  every micro-batch of it (gradient accumulation). What follows in torchtitan's step (the lr schedulers, its
  checkpoint and its log line with its own loss `.item()` and all-reduces) falls into the next step's time.

The counts stay tensors until the probe has synchronized the device at the step's end: no extra syncs.

On a machine without an accelerator (CPU ranks, gloo) and with torch 2.13, torchtitan 0.3.0 needs help in three
places, each documented where it is applied (`_cpu_device`, `_gloo_sums`, `_set_timeout_where_missing`); with an
accelerator and a torch that has `torch.distributed.set_timeout`, torchtitan runs untouched but for the wrappers.

Imports the standard library, torch, torchtitan and raybench's probe only (raybench's source is on PYTHONPATH).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

from raybench.runtime.probe import StepCounter, StepProbe

CONFIG_MODULE = "raybench_torchtitan_job"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0].startswith("-") or argv[1].startswith("-"):
        raise SystemExit("usage: python -m raybench.runtime.stacks.torchtitan_train CONFIG_FILE.py FUNCTION "
                         "[--section.key value ...]   (FUNCTION: a config function of the file, torchtitan's "
                         "--config)")
    config_file, function, overrides = argv[0], argv[1], argv[2:]
    _set_timeout_where_missing()
    if _no_accelerator():
        _cpu_device()
        _gloo_sums()
    load_config_module(config_file)
    from torchtitan import train
    from torchtitan.trainer import Trainer

    measure(Trainer)
    sys.argv = ["torchtitan.train", "--module", CONFIG_MODULE, "--config", function, *overrides]
    train.main()


def load_config_module(path: str) -> types.ModuleType:
    """The job config file as a module torchtitan's ConfigManager imports by name (`--module`); its directory goes
    first on sys.path so that it can import its neighbours."""
    file = Path(path).resolve()
    if not file.is_file():
        raise SystemExit(f"no torchtitan job config file {path}")
    sys.path.insert(0, str(file.parent))
    spec = importlib.util.spec_from_file_location(CONFIG_MODULE, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[CONFIG_MODULE] = module
    spec.loader.exec_module(module)
    return module


def _no_accelerator() -> bool:
    from torch._utils import _get_available_device_type

    return _get_available_device_type() is None


def _set_timeout_where_missing() -> None:
    """torchtitan 0.3.0 shortens every process group's timeout after the first step with
    `torch.distributed.set_timeout`, public in torch releases after 2.13; torch 2.13 has the same function as
    `distributed_c10d._set_pg_timeout`. Where the public name is missing it is that one (any device)."""
    import torch.distributed as dist

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout


def _cpu_device() -> None:
    """torchtitan picks its device type once, at import (`torchtitan.tools.utils.device_type`), as "cuda" when no
    accelerator is present, and calls the CUDA device module's functions (set_device, memory statistics,
    current_device for a barrier's device_ids). Before any other torchtitan module imports them, the device type
    becomes "cpu" and the device module a view of `torch.cpu` that answers the CUDA memory functions torchtitan's
    metrics call: no device memory statistics (the row reads the host's peak RSS on CPU), capacity the host's
    memory, device index 0."""
    import torch
    import torchtitan.tools.utils as utils  # imports only torchtitan's logging: no device_type copied yet

    class CpuDeviceModule(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch.cpu, name)

    cpu = CpuDeviceModule("torch.cpu")
    cpu.current_device = lambda: 0  # torch.cpu's is the string "cpu", which barrier(device_ids=...) refuses
    cpu.get_device_name = lambda device=None: "cpu"
    cpu.get_device_properties = lambda device=None: types.SimpleNamespace(
        total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    cpu.memory_stats = lambda device=None: {}
    cpu.reset_peak_memory_stats = lambda device=None: None
    cpu.empty_cache = lambda: None
    utils.device_type, utils.device_module = "cpu", cpu


def _gloo_sums() -> None:
    """torchtitan normalizes gradients by the global token count itself and so sets every FSDP module's gradient
    divide factor to 1.0; FSDP2 then reduce-scatters with ReduceOp.PREMUL_SUM(1.0), which gloo refuses ("Cannot use
    ReduceOp.PREMUL_SUM with Gloo"). On CPU ranks a divide factor of 1.0 also asks FSDP for plain-sum collectives
    (set_force_sum_reduction_for_comms): the same sum, as ReduceOp.SUM, with nothing to divide afterwards."""
    from torch.distributed.fsdp import FSDPModule

    original = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self, factor: float) -> None:
        original(self, factor)
        if factor == 1.0:
            self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor


# A step without a micro-batch counted: the optimizers stepped outside the loop the wrappers see.
EMPTY_STEP = ("an optimizer step with no micro-batch counted: the trainer's loop is not the one this launcher "
              "measures (docs/stacks/torchtitan.md)")


def measure(trainer_class) -> None:
    """torchtitan's Trainer with its steps timed by the probe (each wrapper calls torchtitan's own method)."""
    from torchtitan.components.loss import IGNORE_INDEX

    train, batch_generator = trainer_class.train, trainer_class.batch_generator
    forward_backward_step = trainer_class.forward_backward_step

    def measured_train(self):
        # The loss each micro-batch adds is its loss sum: the step's is their token-weighted mean (no loss seen,
        # under pipeline parallelism: not known).
        self._raybench_counter = counter = StepCounter(loss_per_token=True, empty_step_error=EMPTY_STEP)
        probe = StepProbe(device=self.device)
        _step_ends_probe_step(self.optimizers, counter, probe)
        _keep_device_peaks(self)
        probe.start()
        train(self)
        _check_steps(len(probe.record.step_times_s), self.config.training.steps)
        probe.finish()

    def counted_batches(self, data_iterable):
        for input_dict, labels in batch_generator(self, data_iterable):
            self._raybench_counter.add(labels.numel(), (labels != IGNORE_INDEX).sum())
            yield input_dict, labels

    def forward_backward_with_loss(self, **kwargs):
        loss = forward_backward_step(self, **kwargs)
        if not self.parallel_dims.pp_enabled:  # under PP, only the last stage's loss is one
            self._raybench_counter.add_loss(loss.detach().float() * kwargs["global_valid_tokens"])
        return loss

    trainer_class.train = measured_train
    trainer_class.batch_generator = counted_batches
    trainer_class.forward_backward_step = forward_backward_with_loss


def _step_ends_probe_step(optimizers, counter: StepCounter, probe: StepProbe) -> None:
    """The optimizers' step() (all of the model parts' optimizers at once) ends one probe step."""
    step = optimizers.step

    def step_and_record(*args, **kwargs):
        result = step(*args, **kwargs)
        counter.end_step(probe)
        return result

    optimizers.step = step_and_record


def _keep_device_peaks(trainer) -> None:
    """torchtitan's metrics reset the device's peak-memory counters after every log line, which the row's peak
    memory reads (the whole run's peak): its own log line then shows the peak since the start."""
    monitor = getattr(getattr(trainer, "metrics_processor", None), "device_memory_monitor", None)
    if monitor is not None and trainer.device.type == "cuda":
        monitor.reset_peak_stats = lambda: None


def _check_steps(done: int, wanted: int) -> None:
    """torchtitan stops early, with a warning only, when a finite dataset runs out (dataloader.infinite false)."""
    if done < wanted:
        raise RuntimeError(f"torchtitan ran {done} optimizer steps of training.steps={wanted} (train.steps): the "
                           "dataset ran out (dataloader.infinite: false) or a checkpoint was resumed; use more data, "
                           "fewer steps or dataloader.infinite: true")


if __name__ == "__main__":
    main()
