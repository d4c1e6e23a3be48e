"""train.loss auto: the loss over the whole logits where the trial fits with it, the chunked loss where memory binds.

Why not always chunked: on a GPU where memory does not bind, the chunked loss is slower. The 1B full fine-tune at
micro-batch 8 on one H200 ran at 0.929x the full loss's tokens/s, A B B A (docs/results/gpu-2026-11-28-h200.md).
Why not always full: where the whole fp32 logits do not fit beside the step, chunking is what lets the trial run.
Issue 49's 8B LoRA on one H100 is such a trial: a 63.7 GiB tensor peak chunked, about 10.6 GiB more with the
full loss (docs/results/lean-loop-2026-11-28.md).

So auto takes the full loss when a GPU trial, run with it, fits its device memory less the margin, by the judgement
that prunes (planning/assessment.py). That judgement reads the full-loss trial's stored rehearsal where there is one,
else the calibrated estimate. Otherwise auto takes the chunked loss: when the trial would not fit, when no memory
limit is known, and on CPU, where chunked was the faster too (docs/results/chunked-loss-2026-11-28.md).
"""

from __future__ import annotations

from collections.abc import Callable

from raybench.planning import calibration, estimate
from raybench.planning.assessment import assess
from raybench.spec.presets import ModelShape
from raybench.spec.sweep_settings import EstimateSpec
from raybench.spec.sweep_spec import TrialConfig


def chosen(config: TrialConfig, shape: ModelShape, blocks: tuple[int, ...], spec: EstimateSpec,
           evidence: calibration.Evidence, rehearsal_of: Callable[[TrialConfig], dict | None]) -> TrialConfig:
    """`config` with train.loss auto resolved to full or chunked (any other value as it is).

    `rehearsal_of` gives a trial's stored rehearsal, or None (plan looks it up by the trial's id)."""
    if config.train.loss != "auto":
        return config
    full = _with_loss(config, "full")
    # Where the loss runs over the whole logits anyway (Liger, DeepSpeed, fp16, a vocabulary-split head), the choice
    # changes nothing that runs: chunked keeps the trial id such trials had before auto existed.
    on_cpu = config.resources.gpus_per_worker == 0
    if on_cpu or config.train.full_loss_reason(shape.tie_word_embeddings) is not None:
        return _with_loss(config, "chunked")
    est = estimate.estimate(full, shape, blocks, spec.gpu)
    judged, _ = assess(est, spec, evidence.factors.get(calibration.key_of(full)),
                       rehearsal_of(full), full.resources.workers)
    return full if judged.fits else _with_loss(config, "chunked")


def _with_loss(config: TrialConfig, loss: str) -> TrialConfig:
    return config.model_copy(update={"train": config.train.model_copy(update={"loss": loss})})
