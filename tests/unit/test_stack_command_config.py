"""A `command` stack's section is checked before anything starts: `raybench plan` exits 2 naming the field, the
value and the fix, and writes nothing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from raybench.drivers.executors import command as command_executor
from raybench.planning.plan import plan
from raybench.planning.stacks import command
from raybench.spec.errors import ConfigError
from raybench.spec.load import load_sweep
from tests.conftest import assert_plan_refuses, write_sweep

COMMAND = '["{python}", "train.py", "--steps", "{steps}", "--mode", "{mode}"]'


def _sweep(stack: str = "", train: str = "{steps: 5}", executor: str = "train") -> str:
    return f"""
name: bad-command
executor: {executor}
model: {{preset: tiny}}
train: {train}
stack:
  kind: command
  command: {COMMAND}
  overrides: {{mode: ok}}
{stack}"""


BAD = {
    "unknown placeholder": (_sweep().replace("{mode}", "{mdoe}"), "stack.command[5]", "unknown placeholder {mdoe}"),
    "unused override": (_sweep().replace("overrides: {mode: ok}", "overrides: {mode: ok, depth: 3}"),
                        "stack.overrides.depth", "is not used in stack.command"),
    "raybench field not used": (_sweep(train="{steps: 5, micro_batch: 4}"), "train.micro_batch",
                                "use {micro_batch} in stack.command"),
    "missing python": (_sweep(stack="  python: /nowhere/venv/bin/python"), "stack.python",
                       "no executable file there"),
    "no command": (_sweep().replace(f"command: {COMMAND}", "command: []"), "stack.command",
                   "needs the argv to run"),
    "format spec": (_sweep().replace("{steps}", "{steps:03d}"), "stack.command[3]", "write {steps} plainly"),
    "null model path": (_sweep().replace("{mode}", "{model_path}").replace("overrides: {mode: ok}", ""),
                        "stack.command[5]", "model.path is null"),
    "pool executor": (_sweep(executor="pool"), "executor", "raybench's own loop only"),
    "no raybench field taken": (_sweep().replace('"--steps", "{steps}", ', ""), "train.steps",
                                "(it takes none of raybench's train fields; docs/stacks/command.md)"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_command_config_exits_2_and_writes_nothing(name, tmp_path, capsys):
    text, field, message = BAD[name]
    sweep = write_sweep(tmp_path / "sweep.yaml", text)
    assert_plan_refuses(sweep, field, message, tmp_path / "store", lambda: capsys.readouterr().err)


def test_a_good_command_fills_its_placeholders(tmp_path):
    text = _sweep(train="{steps: 7, lr: 1.0e-4}").replace(
        COMMAND, '["{python}", "{sweep_dir}/train.py", "--steps", "{steps}", "--lr={lr}", "--mode", "{mode}"]')
    spec = load_sweep(write_sweep(tmp_path / "sweep.yaml", text))
    trials = plan(spec)
    config = trials[0].config
    assert command.argv(config, "/env/bin/python") == [
        "/env/bin/python", f"{tmp_path.resolve()}/train.py", "--steps", "7", "--lr=0.0001", "--mode", "ok"]
    assert set(command.mapped(config)) == {"steps", "lr"}  # the train fields its placeholders take
    assert command_executor._name(command.argv(config, sys.executable)) == Path(sys.executable).name


def test_a_command_stacks_model_needs_only_its_config(tmp_path):
    """raybench reads only config.json of a command's model (the row's parameters and FLOPs); the command loads the
    weights itself, in whatever format it reads."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 128}))
    (model / "consolidated.00.pth").write_bytes(b"")  # torchtune's own checkpoint format
    text = _sweep().replace("{mode}", "{model_path}").replace("overrides: {mode: ok}", "")
    sweep = write_sweep(tmp_path / "sweep.yaml", text.replace("model: {preset: tiny}", f"model: {{path: {model}}}"))
    assert command.argv(plan(load_sweep(sweep))[0].config, "python")[-1] == str(model)
    (model / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        load_sweep(sweep)


def test_the_last_error_line_of_the_command_is_the_message():
    output = ("[rank1]: Traceback (most recent call last):\n[rank1]: ValueError: bad batch shape 7\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n=====\n")
    text = command_executor._failure_text(["python", "-m", "torch.distributed.run"], 1, output)
    assert text.endswith("\nValueError: bad batch shape 7")
    assert "python -m torch.distributed.run exited with status 1" in text


def test_the_default_executor_is_the_warm_pool_unless_a_stack_needs_fresh_processes(tmp_path, capsys):
    """executor: auto (the default) runs raybench's own loop on the warm pool; a sweep any of whose trials runs a
    user's stack (here on an axis) gets Ray Train's fresh workers. `plan` says which, and why."""
    from raybench.cli.main import main

    own = write_sweep(tmp_path / "own.yaml", "name: own\nmodel: {preset: tiny}\n")
    mixed = write_sweep(tmp_path / "mixed.yaml", _sweep().replace("executor: train\n", "").replace(
        "stack:\n  kind: command\n", "axes: {stack.kind: [raybench, command]}\nstack:\n  kind: raybench\n"))
    assert load_sweep(own).executor == "auto" and load_sweep(own).runs_with == "pool"
    assert load_sweep(mixed).runs_with == "train"
    assert load_sweep(write_sweep(tmp_path / "set.yaml", _sweep())).runs_with == "train"  # as set
    assert main(["plan", str(own)]) == 0
    assert "executor pool (auto: every trial runs raybench's own loop" in capsys.readouterr().out
