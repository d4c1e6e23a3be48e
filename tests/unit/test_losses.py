"""`raybench losses`: each point's loss by step against its axis's baseline point (reports/losses.py). The real
rows' check is tests/integration/test_ray_sweep.py (sAC against none, on the smoke sweep's store)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from raybench.reports import losses
from raybench.spec.errors import ConfigError


def rows(*points: tuple[dict, list | None, str]) -> pd.DataFrame:
    return pd.DataFrame([{"trial_id": f"t{i}", "status": status, "axis_values_json": json.dumps(axes),
                          "loss_by_step": by_step} for i, (axes, by_step, status) in enumerate(points)])


BASE = [6.0, 5.0, 4.0, 3.0]


def test_each_point_is_compared_with_the_baseline_of_its_own_group():
    df = rows(({"train.fp8": "off", "train.micro_batch": 4}, BASE, "ok"),
              ({"train.fp8": "tensorwise", "train.micro_batch": 4}, [6.0, 5.05, 4.0, 3.0], "ok"),
              ({"train.fp8": "off", "train.micro_batch": 8}, [7.0, 6.0, 5.0, 4.0], "ok"),
              ({"train.fp8": "rowwise", "train.micro_batch": 8}, [7.0, 6.0, 5.0, 4.4], "ok"),
              ({"train.fp8": "rowwise", "train.micro_batch": 4}, None, "oom"))  # failed: not compared
    found = {(c.group, c.value): c for c in losses.compare_losses(df, "train.fp8", "off")}
    assert set(found) == {("micro_batch=4", "tensorwise"), ("micro_batch=8", "rowwise")}
    close, far = found["micro_batch=4", "tensorwise"], found["micro_batch=8", "rowwise"]
    assert close.max_rel_diff == pytest.approx(0.01) and close.step_of_max == 1 and close.within
    assert close.final_rel_diff == 0 and close.baseline_trial_id == "t0" and close.steps == 4
    assert far.max_rel_diff == pytest.approx(0.1) and far.step_of_max == 3 and not far.within
    assert "BEYOND" in losses.comparison_text(list(found.values()), "train.fp8", "off", 0.02)


def test_steps_without_a_loss_on_either_side_are_left_out():
    nan = float("nan")
    df = rows(({"train.liger": False}, [6.0, nan, 4.0], "ok"), ({"train.liger": True}, [6.0, 9.0, nan], "ok"))
    (only,) = losses.compare_losses(df, "train.liger", "false")
    assert only.steps == 1 and only.max_rel_diff == 0 and only.group == "base"
    disjoint = rows(({"train.liger": False}, [6.0, nan], "ok"), ({"train.liger": True}, [nan, 5.0], "ok"))
    assert losses.compare_losses(disjoint, "train.liger", "false") == []  # no step to compare: no verdict


def test_an_axis_or_baseline_the_rows_lack_is_refused_naming_the_option():
    df = rows(({"train.fp8": "off"}, BASE, "ok"), ({"train.fp8": "rowwise"}, BASE, "ok"))
    with pytest.raises(ConfigError, match="--axis.*train.liger.*train.fp8"):
        losses.compare_losses(df, "train.liger", "false")
    with pytest.raises(ConfigError, match="--baseline.*tensorwise.*'off', 'rowwise'"):
        losses.compare_losses(df, "train.fp8", "tensorwise")
    # A sweep whose every row failed has nothing to compare: said as such, not a KeyError.
    failed = rows(({"train.fp8": "off"}, None, "error"), ({"train.fp8": "rowwise"}, None, "error"))
    with pytest.raises(ConfigError, match="--axis.*no ok row with per-step losses"):
        losses.compare_losses(failed, "train.fp8", "off")


def test_a_window_compares_the_means_of_consecutive_steps():
    """A baseline whose loss jumps at one step (the noise of a full fine-tune at a high learning rate) is beyond
    the tolerance step by step, and within it in 6-step means; a window's verdict names its last step."""
    steady = [4.0, 3.8, 3.6, 3.5, 3.4, 3.3, 3.2, 3.1, 3.0, 2.9, 2.8, 2.7]
    noisy = steady[:5] + [3.63] + steady[6:]
    df = rows(({"train.liger": False}, noisy, "ok"), ({"train.liger": True}, steady, "ok"))
    (by_step,) = losses.compare_losses(df, "train.liger", "false")
    assert not by_step.within and by_step.step_of_max == 5 and by_step.window == 1
    assert by_step.max_rel_diff == pytest.approx(0.33 / 3.63)
    # The baseline's step 5 sits 0.33 over the mean of its neighbours (3.4 and 3.2): the report says so, and
    # offers a window; the steady decrease around it is no noise.
    assert by_step.baseline_noise == pytest.approx(0.33 / 3.3)
    assert "--window 5" in losses.comparison_text([by_step], "train.liger", "false", 0.02)
    (by_six,) = losses.compare_losses(df, "train.liger", "false", window=6)
    # The windows holding step 5 end at steps 5 to 10; the last has the smallest baseline sum (18.63).
    assert by_six.window == 6 and by_six.step_of_max == 10 and by_six.within
    assert by_six.max_rel_diff == pytest.approx(0.33 / 18.63) and by_six.final_rel_diff == 0
    (by_all,) = losses.compare_losses(df, "train.liger", "false", window=20)  # more than the steps: all of them
    assert by_all.window == 12 and by_all.max_rel_diff == pytest.approx(0.33 / 39.63)
    assert "mean of any 6 consecutive steps" in losses.comparison_text([by_six], "train.liger", "false", 0.02, 6)
    steady_pair = rows(({"train.liger": False}, steady, "ok"), ({"train.liger": True}, [x * 1.05 for x in steady], "ok"))
    (trend,) = losses.compare_losses(steady_pair, "train.liger", "false")  # beyond, and no noise to blame
    assert not trend.within and trend.baseline_noise < 0.02
    assert "--window" not in losses.comparison_text([trend], "train.liger", "false", 0.02)


def test_a_window_under_one_step_is_refused_before_any_row_is_read(tmp_path, capsys):
    from raybench.cli import main as cli

    code = cli.main(["losses", str(tmp_path / "no-store"), "--axis", "train.fp8", "--baseline", "off",
                     "--window", "0"])
    assert code == 2 and "--window" in capsys.readouterr().err
