"""Real data (data.source hf): read with `datasets`, tokenized once into a content-keyed cache, laid out per batch
(padded or packed with per-sample position ids), and bad data specs refused before anything starts."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from raybench.cli import main as cli
from raybench.data import tokenized
from raybench.data import json_rows, packing
from raybench.runtime import data
from raybench.spec import tokenized_data
from raybench.spec.sweep_spec import DataSpec, TrialConfig


def chat_spec(path, **extra) -> DataSpec:
    return DataSpec(**{"source": "hf", "path": str(path), "format": "messages", "loss_on": "assistant", **extra})


def test_chat_data_tokenized_once_and_matching_an_independent_count(tmp_path, chat_file, chat_tokenizer,
                                                                   chat_tokens):
    spec = chat_spec(chat_file)
    built = tokenized.prepare(spec, str(chat_tokenizer), tmp_path)
    again = tokenized.prepare(spec, str(chat_tokenizer), tmp_path)
    assert (built.cache, again.cache, again.build_s) == ("build", "hit", None) and built.build_s > 0
    assert again.key == built.key and again.path == built.path
    expected = chat_tokens
    cached = tokenized_data.load(built.path)
    assert [list(r["input_ids"]) for r in cached] == [ids for ids, _ in expected]
    assert [list(r["assistant_masks"]) for r in cached] == [mask for _, mask in expected]
    lengths = [len(ids) for ids, _ in expected]
    assert (built.samples, built.tokens_max) == (len(lengths), max(lengths))
    assert built.tokens_mean == pytest.approx(np.mean(lengths))
    # Memory-mapped from the store's files, not loaded into memory.
    assert cached.cache_files and all(f["filename"].startswith(str(tmp_path)) for f in cached.cache_files)


def test_cache_key_follows_content_and_options_not_layout(tmp_path, chat_file, chat_tokenizer):
    spec = chat_spec(chat_file)
    key = tokenized.cache_key(spec, str(chat_tokenizer), tokenized.data_hash(str(chat_file)))
    same = chat_spec(chat_file, packing=False, num_workers=2)  # the layout is the loader's: one cache for both
    assert tokenized.cache_key(same, str(chat_tokenizer), tokenized.data_hash(str(chat_file))) == key
    changed = tmp_path / "chat.jsonl"
    changed.write_text(chat_file.read_text().replace("fox", "dog"))
    assert tokenized.data_hash(str(changed)) != tokenized.data_hash(str(chat_file))
    for other in (chat_spec(chat_file, max_samples=3), chat_spec(chat_file, loss_on="all")):
        assert tokenized.cache_key(other, str(chat_tokenizer), tokenized.data_hash(str(chat_file))) != key
    template = tmp_path / "tok"
    template.mkdir()
    for f in chat_tokenizer.iterdir():
        (template / f.name).write_bytes(f.read_bytes())
    config = json.loads((template / "tokenizer_config.json").read_text())
    (template / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ messages }}"}))
    assert tokenized.cache_key(spec, str(template), tokenized.data_hash(str(chat_file))) != key


def test_files_directories_and_saved_datasets_read_alike(tmp_path, chat_file, chat_tokenizer):
    import datasets

    records = datasets.load_dataset("json", data_files=str(chat_file), split="train", cache_dir=str(tmp_path / "c"))
    records.to_parquet(str(tmp_path / "repo" / "data" / "train-00000-of-00001.parquet"))
    datasets.DatasetDict({"train": records.select(range(5)), "test": records}).save_to_disk(str(tmp_path / "saved"))
    reference = tokenized_data.load(tokenized.prepare(chat_spec(chat_file), str(chat_tokenizer), tmp_path / "a").path)
    from_repo = tokenized.dataset(chat_spec(tmp_path / "repo"), tmp_path / "b", str(chat_tokenizer))
    from_saved = tokenized.dataset(chat_spec(tmp_path / "saved", split="test"), tmp_path / "b", str(chat_tokenizer))
    assert isinstance(from_repo, datasets.Dataset)  # what another training stack takes as it is
    assert from_repo["input_ids"] == from_saved["input_ids"] == reference["input_ids"]
    first = tokenized.dataset(chat_spec(tmp_path / "saved", max_samples=3), tmp_path / "b", str(chat_tokenizer))
    assert first["input_ids"] == reference["input_ids"][:3]


def test_text_and_alpaca_records_end_with_eos_and_alpaca_can_train_on_responses(tmp_path, alpaca_file,
                                                                                chat_tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_tokenizer)
    text_file = tmp_path / "text.jsonl"
    text_file.write_text("\n".join(json.dumps({"body": t}) for t in ("the quick fox", "a lazy dog jumps")))
    text = tokenized.dataset(DataSpec(source="hf", path=str(text_file), field="body"), tmp_path, str(chat_tokenizer))
    assert text["input_ids"] == [tok("the quick fox")["input_ids"] + [tok.eos_token_id],
                                 tok("a lazy dog jumps")["input_ids"] + [tok.eos_token_id]]
    spec = DataSpec(source="hf", path=str(alpaca_file), format="alpaca", loss_on="assistant")
    alpaca = tokenized.dataset(spec, tmp_path, str(chat_tokenizer))
    record = json.loads(alpaca_file.read_text().splitlines()[0])
    ids, mask = alpaca[0]["input_ids"], alpaca[0]["assistant_masks"]
    assert ids == tok(tokenized_data.format_record(record))["input_ids"] + [tok.eos_token_id]
    response = tok(record["output"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert [t for t, m in zip(ids, mask) if m] == response


def test_rows_pack_whole_samples_and_batches_carry_their_layout(tmp_path, chat_file, chat_tokenizer):
    ref = tokenized.prepare(chat_spec(chat_file), str(chat_tokenizer), tmp_path)
    counts = tokenized_data.lengths(tokenized_data.load(ref.path))
    seq_len = 48
    bounds = packing.row_bounds(counts, seq_len, packing=True)
    sizes = [int(np.minimum(counts, seq_len)[a:b].sum()) for a, b in itertools.pairwise(bounds)]
    assert bounds[0] == 0 and bounds[-1] == len(counts) and max(sizes) <= seq_len and len(sizes) < len(counts)
    assert packing.packing_efficiency(counts, seq_len, True) == pytest.approx(sum(sizes) / (len(sizes) * seq_len))
    rows = data.TokenRows(ref.path, seq_len, packing=True)
    batch = data.collate_rows([rows[0], rows[1]], seq_len, ref.pad_id, packing=True, varlen=True)
    assert batch[data.NONPAD_TOKENS] == sizes[0] + sizes[1] and "attention_mask" not in batch
    first = rows[0]
    starts = np.cumsum([0] + [len(t) for t, _ in first])
    for (tokens, loss), at in zip(first, starts):  # each sample from position 0, its assistant tokens labelled
        assert batch["position_ids"][0, at:at + len(tokens)].tolist() == list(range(len(tokens)))
        want = [t if m and i else -100 for i, (t, m) in enumerate(zip(tokens, loss))]
        assert batch["labels"][0, at:at + len(tokens)].tolist() == want
    assert (batch["labels"][0, starts[-1]:] == -100).all()  # the padded tail
    assert batch["cu_seq_lens_q"].tolist()[:len(first) + 1] == starts.tolist()
    padded = data.collate_rows([rows[0]], seq_len, ref.pad_id, packing=False, varlen=False)
    assert "position_ids" not in padded and int(padded["attention_mask"].sum()) == sizes[0]


def test_packed_samples_attend_only_to_themselves(model_dir):
    """transformers finds the samples from the position ids and masks attention block-causally: each sample's
    logits in a packed row are those it gets alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    a, b = np.array([2, 5, 6, 7, 8]), np.array([2, 9, 10, 11])
    batch = data.collate_rows([[(a, None), (b, None)]], 12, 0, packing=True, varlen=False)
    batch.pop(data.NONPAD_TOKENS)
    with torch.no_grad():
        packed = model(**batch, use_cache=False).logits[0]
        alone = [model(input_ids=torch.from_numpy(s)[None], use_cache=False).logits[0] for s in (a, b)]
    torch.testing.assert_close(packed[:5], alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[5:9], alone[1], atol=1e-5, rtol=1e-5)


def test_loader_workers_build_the_same_batches(tmp_path, model_dir, chat_file, chat_tokenizer):
    """Batches are built per batch from the cached ids, in loader worker processes when asked (data.num_workers)."""
    from raybench.spec.presets import model_shape

    ref = tokenized.prepare(chat_spec(chat_file), str(chat_tokenizer), tmp_path)

    def first_batches(workers: int) -> list[dict]:
        config = TrialConfig.model_validate({
            "model": {"path": str(model_dir)},
            "data": {**chat_spec(chat_file).model_dump(), "tokenizer": str(chat_tokenizer), "num_workers": workers},
            "train": {"seq_len": 48, "micro_batch": 2}})
        it = data.batches(config, model_shape(config), rank=0, world_size=1, ref=ref)
        return [next(it) for _ in range(3)]

    for plain, loaded in zip(first_batches(0), first_batches(2)):
        assert plain.keys() == loaded.keys()
        assert all(torch.equal(plain[k], loaded[k]) if isinstance(plain[k], torch.Tensor) else plain[k] == loaded[k]
                   for k in plain)


def test_a_rank_opens_tokenized_data_and_never_tokenizes(model_dir, chat_file, chat_tokenizer):
    """Tokenizing is the plan's job, done by the sweep's driver before launch: a rank whose payload carries no
    tokenized data refuses the trial instead of tokenizing (the runtime imports nothing of the plan)."""
    from raybench.spec.presets import model_shape

    config = TrialConfig.model_validate({
        "model": {"path": str(model_dir)},
        "data": {**chat_spec(chat_file).model_dump(), "tokenizer": str(chat_tokenizer)},
        "train": {"seq_len": 48, "micro_batch": 2}})
    with pytest.raises(ValueError, match="carries no tokenized data.*with_prepared_data"):
        next(data.batches(config, model_shape(config), rank=0, world_size=1, ref=None))


def _write(tmp_path, data_section: str, model_dir) -> str:
    sweep = tmp_path / "bad.yaml"
    sweep.write_text(f"name: bad\nmodel: {{path: {model_dir}}}\ndata: {data_section}\n"
                     "train: {steps: 2, warmup_steps: 0, seq_len: 32, precision: fp32}\n")
    return str(sweep)


@pytest.mark.parametrize("case, field", [
    ("missing_column", "data.field"),
    ("no_chat_template", "data.tokenizer"),
    ("unknown_split", "data.split"),
    ("not_json", "data.path"),
    ("text_not_messages", "data.field"),
])
def test_bad_data_is_refused_before_anything_starts(tmp_path, capsys, model_dir, chat_file, chat_tokenizer,
                                                    case, field):
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    section = {
        "missing_column": f"{{source: hf, path: {chat_file}, tokenizer: {chat_tokenizer}, field: text}}",
        "no_chat_template": f"{{source: hf, path: {chat_file}, format: messages}}",  # model_dir's tokenizer has none
        "unknown_split": f"{{source: hf, path: {chat_file}, tokenizer: {chat_tokenizer}, format: messages, "
                         f"split: validation}}",
        "not_json": f"{{source: hf, path: {broken}, tokenizer: {chat_tokenizer}}}",
        "text_not_messages": f"{{source: hf, path: {chat_file}, tokenizer: {chat_tokenizer}, field: messages}}",
    }[case]
    sweep = _write(tmp_path, section, model_dir)
    store = tmp_path / "store"
    assert cli.main(["validate", sweep]) == 2
    assert cli.main(["run", sweep, "--store", str(store)]) == 2
    err = capsys.readouterr().err
    assert f"  - {field} = " in err and "nothing was launched or written" in err and "Traceback" not in err
    assert not store.exists()


@pytest.mark.parametrize("changed_file, content", [
    ("chat_template.jinja", "{% for m in messages %}{{ m['content'] }}{% endfor %}"),
    ("added_tokens.json", '{"<tool>": 5000}'),
    ("tokenizer_config.json", None),  # a chat template in the config
])
def test_both_tokenization_caches_key_on_the_same_tokenizer_files(tmp_path, chat_file, alpaca_file, chat_tokenizer,
                                                                   changed_file, content):
    """The JSON-data cache (runtime.data) and the hf cache (data.tokenized) share one key of the tokenizer:
    a changed chat template, added tokens or tokenizer config changes both keys."""
    other = tmp_path / "tok"
    other.mkdir()
    for f in chat_tokenizer.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    if content is None:
        config = json.loads((other / changed_file).read_text())
        content = json.dumps({**config, "chat_template": "{{ messages }}"})
    (other / changed_file).write_text(content)
    json_spec = DataSpec(source="json", path=str(alpaca_file))
    key = json_rows.dataset_cache_key
    assert key(json_spec, str(other), 32) != key(json_spec, str(chat_tokenizer), 32)
    hashed = tokenized.data_hash(str(chat_file))
    spec = chat_spec(chat_file)
    assert tokenized.cache_key(spec, str(other), hashed) != tokenized.cache_key(spec, str(chat_tokenizer), hashed)
    assert tokenized_data.tokenizer_digest(str(other)) != tokenized_data.tokenizer_digest(str(chat_tokenizer))


@pytest.mark.parametrize("name", ["empty_records.jsonl", "empty_records_dir"])
def test_empty_data_says_it_holds_no_records(name, chat_tokenizer):
    """Empty JSON Lines files (datasets' reader raises StopIteration on them) are refused by name, not as a
    StopIteration."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "data" / "bad_sweeps" / name
    found = tokenized.problems(DataSpec(source="hf", path=str(path)), str(chat_tokenizer))
    assert [p.field for p in found] == ["data.path"]
    assert "holds no records" in found[0].message and str(path) in found[0].message
    assert "StopIteration" not in found[0].message


def _chat_tokenizer_with(directory, source, template: str):
    """A copy of the tiny chat tokenizer with another template, and the newline as a token of its own."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source)
    tok.add_tokens(["\n"])
    tok.chat_template = template
    tok.save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)


def _labelled(ids, mask) -> list[int]:
    return [t for t, m in zip(ids, mask) if m]


def _words(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_assistant_mask_leaves_out_the_newline_after_the_end_of_turn(tmp_path, chat_file, chat_tokenizer):
    """A template without generation markers that writes a newline after each turn's end token (as Qwen's after
    <|im_end|>): the assistant's words and end token are labelled, the newline after it is not."""
    template = ("{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s>{{ '\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}<s> assistant :{% endif %}")
    tok = _chat_tokenizer_with(tmp_path / "tok", chat_tokenizer, template)
    assert not tokenized.has_generation_markers(tok)
    built = tokenized.dataset(chat_spec(chat_file), tmp_path / "cache", str(tmp_path / "tok"))
    records = [json.loads(line)["messages"] for line in chat_file.read_text().splitlines()]
    for messages, row in zip(records, built):
        assert tok.convert_ids_to_tokens(row["input_ids"]).count("\n") == len(messages)
        want = [t for m in messages if m["role"] == "assistant" for t in _words(tok, m["content"]) + [tok.eos_token_id]]
        assert _labelled(row["input_ids"], row["assistant_masks"]) == want


def test_generation_markers_give_the_assistant_mask(tmp_path, chat_file, chat_tokenizer):
    """A template with {% generation %} markers: the mask is the one they give (transformers'
    return_assistant_tokens_mask), here the assistant's words without its end token."""
    template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<s> assistant : {% generation %}"
                "{{ m['content'] }}{% endgeneration %} </s>{{ '\\n' }}{% else %}<s> {{ m['role'] }} : "
                "{{ m['content'] }} </s>{{ '\\n' }}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<s> assistant :{% endif %}")
    tok = _chat_tokenizer_with(tmp_path / "tok", chat_tokenizer, template)
    assert tokenized.has_generation_markers(tok)
    built = tokenized.dataset(chat_spec(chat_file), tmp_path / "cache", str(tmp_path / "tok"))
    records = [json.loads(line)["messages"] for line in chat_file.read_text().splitlines()]
    for messages, row in zip(records, built):
        given = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert row["input_ids"] == list(given["input_ids"]) and row["assistant_masks"] == list(given["assistant_masks"])
        want = [t for m in messages if m["role"] == "assistant" for t in _words(tok, m["content"])]
        assert _labelled(row["input_ids"], row["assistant_masks"]) == want
