"""A torchtune recipe, run by torchtune's own code, its optimizer steps timed by raybench's probe.

Runs inside torchtune's environment (stack.python), under torchrun, one process per rank:

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        -m raybench.runtime.stacks.torchtune_recipe lora_finetune_distributed --config my.yaml key=value ...

It loads the installed recipe's file (torchtune's `recipes/<name>.py`, the one `tune run` runs) and calls its own
`recipe_main`, so torchtune parses --config and the key=value overrides, sets up the process group, builds and sets
up the recipe and trains exactly as it would alone. The one change: the recipe's class, looked up by recipe_main
at call time, is replaced by a subclass whose train() hooks the probe in after setup() and calls the recipe's own
train():

- tokens: the recipe's dataloader is wrapped to count each micro-batch as it is yielded, `labels.numel()` (padding
  included) and `labels != loss_fn.ignore_index` (the count torchtune itself normalizes the loss by and reports
  as its tokens/s: the tokens that carry loss; prompt tokens too unless the dataset masks them);
- loss: a forward hook on the recipe's loss module keeps each micro-batch's loss, weighted by its counted tokens
  as the recipe weights it (`loss_fn(logits, labels) * current_num_tokens`): this rank's token-weighted mean over
  the optimizer step, without the all-reduce the recipe does for its log line;
- the step's end: a post-hook on the optimizer's step() closes one probe step per optimizer step with the
  micro-batches counted since the last one (gradient accumulation included). What follows in the recipe's step
  block (zero_grad, the lr scheduler's step, its loss .item() and log line) falls into the next step's time.

The counts stay tensors until the probe has synchronized the device at the step's end: no extra syncs.

Imports the standard library, torch, torchtune's `recipes` and raybench's probe only (raybench's source is on
PYTHONPATH; `raybench`, `raybench.runtime` and `raybench.runtime.stacks` import nothing at package import).
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import inspect
import sys
import types

from raybench.runtime.probe import StepCounter, StepProbe


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: python -m raybench.runtime.stacks.torchtune_recipe RECIPE --config FILE "
                         "[key=value ...]   (RECIPE: a torchtune recipe, e.g. lora_finetune_distributed)")
    recipe_name, rest = argv[0], argv[1:]
    module = load_recipe(recipe_name)
    recipe_class = _recipe_class(module)
    setattr(module, recipe_class.__name__, measured(recipe_class))
    _gloo_where_no_nccl(module)
    _no_memory_stats_on_cpu(module)
    sys.argv = [recipe_name, *rest]  # torchtune's config.parse reads --config and the overrides from sys.argv
    module.recipe_main()


def load_recipe(name: str):
    """The built-in recipe's module, loaded from the file `tune run` runs (torchtune's recipes directory is not
    an importable package: its __init__ raises)."""
    from torchtune._cli.run import ROOT
    from torchtune._recipe_registry import get_all_recipes

    recipes = {recipe.name: recipe for recipe in get_all_recipes()}
    if name not in recipes:
        raise SystemExit(f"torchtune has no recipe {name!r}; its recipes: {', '.join(sorted(recipes))}")
    path = ROOT / "recipes" / recipes[name].file_path
    module_name = f"torchtune_recipe_{name.replace('/', '_')}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def _recipe_class(module):
    """The training recipe class the module defines (torchtune's FTRecipeInterface)."""
    from torchtune.recipe_interfaces import FTRecipeInterface

    found = [obj for obj in vars(module).values() if inspect.isclass(obj) and obj.__module__ == module.__name__
             and FTRecipeInterface in obj.__mro__]  # a Protocol: issubclass() refuses it
    if len(found) != 1 or not hasattr(module, "recipe_main"):
        raise SystemExit(f"{module.__name__} is not a torchtune fine-tuning recipe (one FTRecipeInterface class "
                         "and a recipe_main)")
    return found[0]


def _gloo_where_no_nccl(module) -> None:
    """torchtune's LoRA recipes call init_process_group("cuda:nccl,cpu:gloo"), which a torch built without NCCL
    (the CPU wheels) refuses outright even for CPU tensors. Where NCCL is missing, the recipe module's own
    reference drops the nccl part ("cpu:gloo"); everywhere else the call is torchtune's, unchanged."""
    import torch.distributed as dist

    original = getattr(module, "init_process_group", None)
    if original is None or dist.is_nccl_available():
        return

    def init_process_group(backend=None, *args, **kwargs):
        if isinstance(backend, str) and ":" in backend:
            kept = [part for part in backend.split(",") if part.split(":")[-1].strip() != "nccl"]
            backend = ",".join(kept) or backend
        return original(backend, *args, **kwargs)

    module.init_process_group = init_process_group


def _no_memory_stats_on_cpu(module) -> None:
    """torchtune 0.6.1's distributed recipes call device-memory functions that fail on a machine without an
    accelerator: rank 0 logs get_memory_stats() after building the model, whatever the device (it raises for the
    CPU), and train() begins with cleanup_before_training(), which calls torch.cpu.empty_cache() (no such
    function). On such a machine only, the recipe module's own `training` reference gets a view of
    torchtune.training in which the memory log line is skipped and the clean-up is its gc.collect(); with an
    accelerator the recipe is untouched."""
    from torchtune.utils import get_device_support

    training = getattr(module, "training", None)
    if get_device_support().device_type != "cpu" or not isinstance(training, types.ModuleType):
        return

    class TrainingView(types.ModuleType):
        def __getattr__(self, name):
            return getattr(training, name)

    view = TrainingView(training.__name__)
    view.get_memory_stats = lambda device, *args, **kwargs: {}
    view.log_memory_stats = lambda stats, *args, **kwargs: None
    view.cleanup_before_training = gc.collect
    module.training = view


# A step without a micro-batch counted: the optimizer stepped outside the loop the hooks see.
EMPTY_STEP = ("an optimizer step with no micro-batch counted: the recipe's loop is not the one this launcher "
              "measures (docs/stacks/torchtune.md)")


class _CountingLoader:
    """The recipe's dataloader, counting each batch as the recipe receives it (its labels: every one, and those
    that carry loss); everything else (sampler, state_dict, len) is the dataloader's own."""

    def __init__(self, loader, counter: StepCounter, ignore_index: int):
        self._loader = loader
        self._counter = counter
        self._ignore_index = ignore_index

    def __iter__(self):
        for batch in self._loader:
            labels = batch["labels"]
            self._counter.add(labels.numel(), (labels != self._ignore_index).sum())
            yield batch

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def measured(recipe_class):
    """The recipe class, with its train() timed per optimizer step by the probe."""

    class Measured(recipe_class):
        def train(self) -> None:
            self._check_steps()
            probe = StepProbe(device=self._device)
            counter = StepCounter(loss_per_token=True, empty_step_error=EMPTY_STEP)
            self._dataloader = _CountingLoader(self._dataloader, counter, self._loss_fn.ignore_index)
            # The recipe weights each micro-batch's mean loss by its own counted tokens before accumulating.
            self._loss_fn.register_forward_hook(
                lambda module, inputs, output: counter.add_loss(output.detach().float() * counter.last_nonpad_tokens))
            if not hasattr(self._optimizer, "register_step_post_hook"):
                raise RuntimeError("the recipe's optimizer has no step hook (optimizer_in_bwd: true?); raybench "
                                   "times torchtune recipes with optimizer_in_bwd: false")
            self._optimizer.register_step_post_hook(lambda optimizer, args, kwargs: counter.end_step(probe))
            probe.start()
            super().train()
            probe.finish()

        def _check_steps(self) -> None:
            """The data gives every step asked for: torchtune ends its epoch early, without saying so, when the
            dataloader runs out before max_steps_per_epoch."""
            wanted = self.max_steps_per_epoch
            if wanted is not None and self._steps_per_epoch < wanted:
                raise RuntimeError(
                    f"the dataset gives each rank {len(self._dataloader)} batches of batch_size="
                    f"{self._dataloader.batch_size}, only "
                    f"{self._steps_per_epoch} optimizer steps of gradient_accumulation_steps="
                    f"{self._gradient_accumulation_steps}, fewer than max_steps_per_epoch={wanted} (train.steps); "
                    "use more data or fewer steps")

    Measured.__name__ = recipe_class.__name__
    Measured.__qualname__ = recipe_class.__qualname__
    return Measured


if __name__ == "__main__":
    main()
