"""train.loss auto (planning/loss_choice.py): the full loss where the trial fits its device with it, the chunked
loss where it would not or where no device memory is known; trial ids are those of the loss chosen."""

from __future__ import annotations

import json

from rehearse_cases import TINY_TRAIN

from raybench.cli.main import main
from raybench.planning.plan import plan
from raybench.results import rehearsals
from raybench.spec.load import parse_sweep

# The 1B full fine-tune of docs/results/gpu-2026-11-28-h200.md (where the full loss ran 1.077x the chunked one at
# micro-batch 8), at micro-batch 12: on an H100 the whole logits no longer fit beside the step.
ONE_B = {"name": "l", "model": {"preset": "llama-3.2-1b"},
         "train": {"strategy": "fsdp2", "precision": "bf16", "seq_len": 2048, "micro_batch": 12},
         "resources": {"workers": 1, "gpus_per_worker": 1}}


def planned(sweep: dict, **kw):
    (trial,) = plan(parse_sweep(sweep), **kw)
    return trial


def with_(sweep: dict, section: str, **values) -> dict:
    return {**sweep, section: {**sweep.get(section, {}), **values}}


def test_auto_is_the_full_loss_where_it_fits_and_chunked_where_only_chunked_fits():
    roomy = planned(with_(ONE_B, "estimate", gpu="H200"))  # 141 GB
    tight = planned(with_(ONE_B, "estimate", gpu="H100 SXM"))  # 80 GB: the whole logits do not fit beside the step
    assert roomy.config.train.loss == "full" and roomy.assessment.fits
    assert tight.config.train.loss == "chunked" and tight.assessment.fits
    # Each is the trial of the loss it chose: the same id as that loss set in the sweep.
    assert roomy.trial_id == planned(with_(with_(ONE_B, "estimate", gpu="H200"), "train", loss="full")).trial_id
    assert tight.trial_id == planned(with_(with_(ONE_B, "estimate", gpu="H100 SXM"), "train", loss="chunked")).trial_id
    # The full loss would not have fit the H100: what the chunked one saves is what makes it fit.
    whole = planned(with_(with_(ONE_B, "estimate", gpu="H100 SXM", prune=False), "train", loss="full"))
    assert whole.assessment.fits is False


def test_auto_is_chunked_without_a_memory_limit_and_on_cpu():
    on_gpu = planned(ONE_B)  # no estimate.gpu: nothing to judge a fit by
    assert on_gpu.assessment.fits is None and on_gpu.config.train.loss == "chunked"
    # On CPU the chunked loss was the faster (docs/results/chunked-loss-2026-11-28.md), room or not.
    on_cpu = planned({**ONE_B, "model": {"preset": "tiny"}, "resources": {"workers": 1, "gpus_per_worker": 0},
                      "estimate": {"device_memory_gib": 1000}})
    assert on_cpu.assessment.fits and on_cpu.config.train.loss == "chunked"


def test_a_stored_rehearsal_of_the_full_loss_that_does_not_fit_turns_auto_chunked(tmp_path):
    sweep = with_(ONE_B, "estimate", gpu="H200")
    full = planned(sweep)
    assert full.config.train.loss == "full"
    rehearsals.save_rehearsal(tmp_path, full.config_id, {"method": "traced", "peak_gib": 150.0,
                                                          "reserved_gib": 170.0})
    chunked = planned(sweep, store_path=tmp_path)
    assert chunked.config.train.loss == "chunked" and chunked.config_id != full.config_id


def test_where_the_loss_runs_whole_anyway_auto_keeps_the_chunked_trial():
    """Under DeepSpeed the loss runs over the whole logits whatever train.loss says: auto resolves to chunked,
    the trial id such trials had before auto existed."""
    sweep = with_(with_(ONE_B, "estimate", gpu="H200"), "train", strategy="deepspeed")
    trial = planned(sweep)
    assert trial.config.train.loss == "chunked"
    assert trial.trial_id == planned(with_(sweep, "train", loss="chunked")).trial_id


def test_rehearse_rehearses_the_chunked_trial_when_the_full_ones_rehearsal_does_not_fit(tmp_path, capsys):
    """The plan picks the full loss by its estimate; the rehearsal then finds it does not fit, so the plan picks
    the chunked loss from then on: `raybench rehearse` rehearses that trial too, and the estimate judges it."""
    def sweep(name: str, memory_gib: float) -> str:
        path = tmp_path / f"{name}.yaml"
        path.write_text(json.dumps({
            "name": "r", "model": {"preset": "tiny"},
            "train": {**TINY_TRAIN, "strategy": "fsdp2", "micro_batch": 8, "loss": "auto"},
            "resources": {"workers": 2, "gpus_per_worker": 1},
            "estimate": {"gpu": "H100 SXM", "device_memory_gib": memory_gib, "margin_gib": 0},
            "store": str(tmp_path / name)}))
        return str(path)

    roomy = sweep("roomy", 80.0)
    assert main(["rehearse", roomy, "--json", "--jobs", "1"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    (full,) = plan(parse_sweep(json.loads(open(roomy).read())), store_path=tmp_path / "roomy")
    assert full.config.train.loss == "full" and row["config_id"] == full.config_id
    estimated, rehearsed = full.assessment.peak_calibrated_gib, full.assessment.rehearsed_peak_gib
    # The case needs a limit between the two: the estimate under the rehearsed peak (the logits it does not count).
    assert estimated < rehearsed
    tight = sweep("tight", (estimated + rehearsed) / 2)
    assert main(["rehearse", tight, "--json", "--jobs", "1"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    (chunked,) = plan(parse_sweep(json.loads(open(tight).read())), store_path=tmp_path / "tight")
    assert [r["config_id"] for r in rows] == [full.config_id, chunked.config_id]
    assert chunked.config.train.loss == "chunked"
    assert chunked.assessment.peak_basis == "rehearsed" and chunked.assessment.fits
