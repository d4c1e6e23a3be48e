"""The torchtune stack checked before launch: a torchtune recipe in torchtune's own environment
(docs/stacks/torchtune.md).

A trial runs `stack.python -m torch.distributed.run ... -m raybench.runtime.stacks.torchtune_recipe RECIPE --config
stack.config key=value ...` (`argv`): torchtune parses the config file and the key=value overrides itself, in this
order: the file, stack.overrides, then raybench's train fields that map exactly (`mapped_values`), so a mapped
key is refused in the overrides. Here the recipe is one raybench measures, the config file is a readable mapping,
and every override names a key the file has (a new key is written `+key`); the interpreter (stack.python) is
checked for every kind that runs in its own environment (planning.stacks.problems).

PyYAML only: torchtune is not imported (it lives in stack.python's environment, not raybench's).
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from raybench.spec.errors import Problem
from raybench.spec.finetunes import LORA
from raybench.spec.load import PLACEHOLDER
from raybench.spec.stacks import kind
from raybench.spec.sweep_spec import DataSpec, LoraSpec, TrialConfig
from raybench.spec.strategies import FSDP2

# torchtune 0.6.1's recipes (`tune ls`), each with the train.finetune it is; None: a recipe raybench does not
# time (single device, preference and distillation losses, inference): its loop is not the SFT loop the launcher
# hooks (one labels batch per micro-batch, one optimizer step per gradient_accumulation_steps).
RECIPES = {
    "lora_finetune_distributed": "lora",
    "full_finetune_distributed": "full",
    "lora_finetune_single_device": None,
    "full_finetune_single_device": None,
    "lora_dpo_distributed": None,
    "lora_dpo_single_device": None,
    "full_dpo_distributed": None,
    "ppo_full_finetune_single_device": None,
    "qat_distributed": None,
    "qat_lora_finetune_distributed": None,
    "knowledge_distillation_distributed": None,
    "knowledge_distillation_single_device": None,
    "dev/lora_finetune_distributed_multi_dataset": None,
    "dev/early_exit_finetune_distributed": None,
    "dev/generate_v2": None,
    "dev/generate_v2_distributed": None,
    "generate": None,
    "eleuther_eval": None,
    "quantize": None,
}

TORCHTUNE = kind("torchtune")
# The torchtune keys raybench sets on every trial's command line (refused in stack.overrides): the field that sets
# each, from the registry's table (epochs is 1: one epoch of train.steps steps).
SET_KEYS = {**TORCHTUNE.set_keys(), "epochs": "train.steps (one epoch of train.steps steps)"}
# LoRA recipes only: the adapters, from train.lora.
# Which layers get adapters stays the config's (model.lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output):
# torchtune picks attention projections one by one (its Llama configs adapt q, v and output_proj, not k), which
# raybench's train.lora.targets cannot say; targets is refused off its default.
LORA_KEYS = {"model.lora_rank": "train.lora.rank", "model.lora_alpha": "train.lora.alpha",
             "model.lora_dropout": "train.lora.dropout"}
# model.path, where set: the Hugging Face directory torchtune's checkpointer loads.
MODEL_KEYS = {"checkpointer.checkpoint_dir": "model.path", "checkpointer.checkpoint_files": "model.path"}


def mapped(config: TrialConfig) -> dict[str, tuple[str, ...]]:
    """The train fields every torchtune trial takes, with the torchtune keys each becomes (the registry's table)."""
    return TORCHTUNE.mapped


def problems(config: TrialConfig) -> list[Problem]:
    stack = config.stack
    found = [Problem(f"stack.{name}", getattr(stack, name), "stack torchtune runs stack.recipe with stack.config; "
                     f"{name} is for other stacks: remove it") for name in ("entry", "command") if getattr(stack, name)]
    if stack.pythonpath:
        found.append(Problem("stack.pythonpath", stack.pythonpath, "stack torchtune imports nothing of yours: "
                             "remove it (recipes are torchtune's own, installed in stack.python's environment)"))
    found += _recipe_problems(config)
    found += _train_problems(config)
    found += _model_data_problems(config)
    from_file, file_problems = _config_file(stack.config)
    if file_problems:
        return found + file_problems
    found += _override_problems(stack.overrides, from_file, config)
    found += _placeholder_problems(from_file, stack.overrides, config)
    found += _harness_problems(from_file, stack.overrides)
    return found


def _harness_problems(from_file: dict, overrides: dict[str, Any]) -> list[Problem]:
    """Config values that would change what the row measures."""
    settings = {**_flat_keys(from_file), **{key.lstrip("+"): value for key, value in overrides.items()}}
    if settings.get("log_peak_memory_stats") is True:
        where = "stack.overrides.log_peak_memory_stats" if "log_peak_memory_stats" in overrides else "stack.config"
        return [Problem(where, True, "log_peak_memory_stats resets CUDA's peak-memory counters at every step, "
                        "which the row's peak memory reads: set it false (the row has the peaks)")]
    return []


def _recipe_problems(config: TrialConfig) -> list[Problem]:
    recipe = config.stack.recipe
    measured = [name for name, kind in RECIPES.items() if kind]
    if recipe is None:
        return [Problem("stack.recipe", None, f"stack torchtune needs the recipe to run: one of "
                        f"{', '.join(measured)}")]
    if recipe not in RECIPES:
        close = difflib.get_close_matches(recipe, list(RECIPES), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        return [Problem("stack.recipe", recipe, f"not a torchtune 0.6.1 recipe; {hint}raybench times "
                        f"{', '.join(measured)}")]
    kind = RECIPES[recipe]
    if kind is None:
        return [Problem("stack.recipe", recipe, f"raybench times torchtune's distributed fine-tuning recipes "
                        f"({', '.join(measured)}); this one's loop is not theirs (docs/stacks/torchtune.md)")]
    if config.train.finetune != kind:
        return [Problem("train.finetune", config.train.finetune, f"recipe {recipe} trains {kind}: set "
                        f"train.finetune: {kind} (the row's finetune column), or run "
                        f"{_recipe_for(config.train.finetune)}")]
    return []


def _recipe_for(finetune: str) -> str:
    names = [name for name, kind in RECIPES.items() if kind == finetune]
    return names[0] if names else "raybench's own loop (qlora: a torchtune qlora_* model builder under lora)"


def _train_problems(config: TrialConfig) -> list[Problem]:
    """Mapped fields whose value has no torchtune equivalent."""
    train = config.train
    found = []
    if train.parallelism is not FSDP2:
        found.append(Problem("train.strategy", train.strategy, "torchtune's distributed recipes shard with FSDP2: "
                             "set train.strategy: fsdp2 (the row's strategy column)"))
    if train.precision == "fp16":
        found.append(Problem("train.precision", train.precision, "torchtune's distributed recipes refuse fp16; "
                             "use bf16 or fp32 (torchtune's dtype)"))
    if train.ac_ratio not in ("0", "1"):
        found.append(Problem("train.ac_ratio", train.ac_ratio, "torchtune checkpoints every decoder block or none "
                             "(enable_activation_checkpointing): use '0' or '1'"))
    if train.tuning is LORA and train.lora.targets != LoraSpec().targets:
        found.append(Problem("train.lora.targets", train.lora.targets, "torchtune's config picks the adapted "
                             "layers: set model.lora_attn_modules, model.apply_lora_to_mlp and "
                             "model.apply_lora_to_output (in the file or stack.overrides) and leave targets out"))
    if train.tuning is LORA and train.lora.base_dtype not in ("auto", train.precision):
        found.append(Problem("train.lora.base_dtype", train.lora.base_dtype, "torchtune keeps the frozen base in "
                             "its dtype (train.precision); leave base_dtype at auto"))
    return found


def _model_data_problems(config: TrialConfig) -> list[Problem]:
    """raybench's data section is not read (the dataset is the config's `dataset`); model.path, where set, is the
    checkpointer's directory and must hold safetensors weights (the loader checked config.json)."""
    defaults = DataSpec()
    found = [Problem(f"data.{name}", getattr(config.data, name), "stack torchtune reads its dataset from the "
                     "recipe config (dataset.*, e.g. dataset.data_files in stack.overrides); remove it")
             for name in DataSpec.model_fields if getattr(config.data, name) != getattr(defaults, name)]
    path = config.model.path
    if path is not None and not path.startswith(PLACEHOLDER) and Path(path).is_dir() and not _weights(path):
        found.append(Problem("model.path", path, "torchtune's checkpointer loads safetensors here; none found"))
    return found


def _weights(model_path: str) -> list[str]:
    return sorted(p.name for p in Path(model_path).glob("*.safetensors"))


def read_config_file(path: str) -> dict[str, Any]:
    import yaml

    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"expected a mapping of torchtune config keys, got {type(data).__name__}")
    return data


def _config_file(path: str | None) -> tuple[dict[str, Any], list[Problem]]:
    if path is None:
        return {}, [Problem("stack.config", None, "stack torchtune needs the recipe's config file: copy one with "
                            "`tune cp llama3_2/1B_lora my_config.yaml` and edit it")]
    if not Path(path).is_file():
        return {}, [Problem("stack.config", path, "file not found; the recipe's YAML config (`tune cp ...`)")]
    try:
        return read_config_file(path), []
    except Exception as err:  # a YAML syntax error, a list instead of a mapping
        return {}, [Problem("stack.config", path, f"cannot be read: {type(err).__name__}: {err}")]


def _flat_keys(data: dict, prefix: str = "") -> dict[str, Any]:
    """Every dotted key of the nested mapping, inner mappings included (`model` and `model.lora_rank`)."""
    keys = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        keys[dotted] = value
        if isinstance(value, dict):
            keys.update(_flat_keys(value, f"{dotted}."))
    return keys


def _refused_keys(config: TrialConfig) -> dict[str, str]:
    """torchtune keys raybench sets for this trial -> the raybench field that sets them."""
    refused = dict(SET_KEYS)
    if RECIPES.get(config.stack.recipe) == "lora":
        refused.update(LORA_KEYS)
    if config.model.path is not None:
        refused.update(MODEL_KEYS)
    return refused


def _override_problems(overrides: dict[str, Any], from_file: dict, config: TrialConfig) -> list[Problem]:
    keys = _flat_keys(from_file)
    refused = _refused_keys(config)
    found = []
    for raw_key, value in overrides.items():
        field = f"stack.overrides.{raw_key}"
        key = raw_key[1:] if raw_key.startswith("+") else raw_key
        if not key or any(c in key for c in "= ~+") or key.startswith(".") or key.endswith("."):
            found.append(Problem(field, value, "a torchtune config key in dotted form, e.g. optimizer.fused "
                                 "(+key for a key the file does not have)"))
        elif key in refused:
            found.append(Problem(field, value, f"raybench sets {key} from {refused[key]}: set that instead "
                                 "(docs/stacks/torchtune.md)"))
        elif raw_key.startswith("+") and key in keys:
            found.append(Problem(field, value, f"the config file has {key}; write it without the +"))
        elif not raw_key.startswith("+") and key not in keys:
            close = difflib.get_close_matches(key, list(keys), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            found.append(Problem(field, value, f"the config file has no key {key}; {hint}write +{key} to add a "
                                 "key the file does not have"))
        elif "=" in cli_value(value):
            found.append(Problem(field, value, "torchtune's command line splits key=value at every '=': a value "
                                 "cannot contain one; set it in the config file"))
    return found


def _placeholder_problems(from_file: dict, overrides: dict[str, Any], config: TrialConfig) -> list[Problem]:
    """A shipped config's /EDIT-ME/ paths, in the file or the overrides, that this trial still has."""
    found = [Problem(f"stack.overrides.{key}", value, "a placeholder: set it to the path of your local copy")
             for key, value in overrides.items() if isinstance(value, str) and value.startswith(PLACEHOLDER)]
    overridden = {key.lstrip("+") for key in overrides} | set(_refused_keys(config))
    found += [Problem("stack.config", config.stack.config, f"{key}: {value} is a placeholder; set it in the file "
                      f"or as stack.overrides.{key}")
              for key, value in _flat_keys(from_file).items()
              if isinstance(value, str) and value.startswith(PLACEHOLDER) and key not in overridden]
    return found


# torchtune's LoRA layer names -> raybench's (Hugging Face) projection names (planning.estimate.projection_shapes).
TORCHTUNE_PROJECTIONS = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # torchtune's w1, w3, w2


def trial_settings(config: TrialConfig) -> dict[str, Any]:
    """The trial's torchtune config as the recipe sees it, dotted keys: the file, the overrides, raybench's."""
    from_file = read_config_file(config.stack.config) if config.stack.config else {}
    overrides = {key.lstrip("+"): value for key, value in config.stack.overrides.items()}
    return {**_flat_keys(from_file), **overrides, **mapped_values(config)}


def adapter_params(config: TrialConfig, shape) -> int:
    """LoRA parameters the trial's config adds to a model of `shape` (planning.estimate's ModelShape): rank x (in +
    out) per adapted projection per block, and the output head where apply_lora_to_output (0: a full recipe). The
    layers are the config's (model.lora_attn_modules, apply_lora_to_mlp), not train.lora.targets."""
    if RECIPES.get(config.stack.recipe) != "lora":
        return 0
    from raybench.planning.estimate import projection_shapes

    settings = trial_settings(config)
    rank = config.train.lora.rank
    names = [TORCHTUNE_PROJECTIONS[m] for m in settings.get("model.lora_attn_modules") or []
             if m in TORCHTUNE_PROJECTIONS]
    if settings.get("model.apply_lora_to_mlp"):
        names += MLP_PROJECTIONS
    shapes = projection_shapes(shape)
    per_block = sum(rank * (shapes[n][0] + shapes[n][1]) for n in names)
    head = rank * (shape.hidden_size + shape.vocab_size) if settings.get("model.apply_lora_to_output") and \
        not shape.tie_word_embeddings else 0  # torchtune ignores it for a tied head (Llama-3.2)
    return shape.num_hidden_layers * per_block + head


def cli_value(value: Any) -> str:
    """A value as torchtune's command line reads it (OmegaConf parses it as YAML): null, true/false, numbers
    and lists as YAML, strings as they are."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    return json.dumps(value)


def mapped_values(config: TrialConfig) -> dict[str, Any]:
    """raybench's fields as torchtune keys, for this trial (`problems` found nothing wrong)."""
    train = config.train
    values = {
        "epochs": 1,
        "max_steps_per_epoch": train.steps,
        "batch_size": train.micro_batch,
        "gradient_accumulation_steps": train.grad_accum,
        "seed": train.seed,
        "optimizer.lr": train.lr,
        "optimizer.weight_decay": train.weight_decay,
        "clip_grad_norm": train.max_grad_norm,
        "dtype": train.precision,
        "tokenizer.max_seq_len": train.seq_len,
        "compile": train.compile,
        "enable_activation_checkpointing": train.ac_ratio == "1",
        "fsdp_reshard_after_forward": train.reshard_after_forward,
    }
    if RECIPES.get(config.stack.recipe) == "lora":
        values.update(lora_values(train.lora))
    if config.model.path is not None:
        values["checkpointer.checkpoint_dir"] = config.model.path
        values["checkpointer.checkpoint_files"] = _weights(config.model.path)
    return values


def lora_values(lora: LoraSpec) -> dict[str, Any]:
    """train.lora as torchtune's LoRA model-builder arguments (the adapted layers stay the config's)."""
    return {"model.lora_rank": lora.rank, "model.lora_alpha": lora.alpha, "model.lora_dropout": lora.dropout}


def argv(config: TrialConfig, python: str) -> list[str]:
    """The trial's command: torchrun over this machine's ranks (python: stack.python, torchtune's environment), the
    launcher (the registry's runtime module), torchtune's own CLI arguments."""
    stack = config.stack
    overrides = {key.lstrip("+"): value for key, value in stack.overrides.items()}
    pairs = {**overrides, **mapped_values(config)}
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(config.resources.workers), "-m", TORCHTUNE.runtime, stack.recipe, "--config", stack.config,
            *(f"{key}={cli_value(value)}" for key, value in pairs.items())]
