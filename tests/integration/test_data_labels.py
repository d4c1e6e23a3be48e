"""A trial whose batches hold no label tokens ends as an error naming the cause, never ok with a nan loss.

Slow (about 30 s of torchrun on 2 cores): the default run covers its parts apart, the rule in
tests/unit/test_probe.py::test_a_batch_without_label_tokens_fails_the_trial_naming_the_cause and the loop's label
counts in tests/unit/test_model_data.py."""

from __future__ import annotations

import json

import pytest

from raybench.cli import main as cli
from raybench.results import store
from tests.conftest import WORDS

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_chat_samples_truncated_before_any_assistant_token_fail_the_trial(tmp_path, model_dir, chat_tokenizer,
                                                                          capsys):
    # Each user turn is 20 words: at seq_len 16 truncation leaves no assistant token in any sample.
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(json.dumps({"messages": [
        {"role": "user", "content": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(20))},
        {"role": "assistant", "content": " ".join(WORDS[:4])}]}) for i in range(8)))
    sweep = tmp_path / "labels.yaml"
    sweep.write_text(f"""
name: labels
model: {{path: {model_dir}}}
data: {{source: hf, path: {chat}, tokenizer: {chat_tokenizer}, format: messages, loss_on: assistant,
        packing: false}}
train: {{steps: 3, warmup_steps: 1, seq_len: 16, micro_batch: 2, precision: fp32}}
resources: {{workers: 1}}
store: {tmp_path / 'store'}
""")
    assert cli.main(["trial", str(sweep), "0"]) == 1
    assert "data.overflow cut 8 of 8 samples" in capsys.readouterr().out
    row = store.read_results(tmp_path / "store").iloc[0]
    assert row.status == "error" and "step 0: the global batch holds no label tokens" in row.message
    assert (row.samples_cut, row.label_tokens_cut_frac) == (8, 1.0)
