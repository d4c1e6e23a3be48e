"""How real data (data.source hf) is laid out in rows and batches: overflow (truncate or split samples longer than
seq_len), pack_order (in order or best-fit decreasing) and pad_to (seq_len, or each batch's longest row rounded up
to pad_multiple); the layout's packing efficiency; refusals of options that need another; unchanged trial ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raybench.cli import main as cli
from raybench.data import tokenized
from raybench.planning.plan import config_id, plan
from raybench.data import packing
from raybench.runtime import data
from raybench.spec.errors import ConfigError
from raybench.spec.load import parse_sweep
from raybench.spec.presets import model_shape
from raybench.spec.sweep_spec import DataSpec, TrialConfig
from raybench.spec.tokenized_data import TokenizedData

IGNORE = data.IGNORE_INDEX


def row_pieces(rows: packing.Rows) -> list[list[tuple[int, int, int]]]:
    """Each row's pieces as (sample, start, length)."""
    return [[(int(rows.sample[p]), int(rows.start[p]), int(rows.length[p])) for p in range(a, b)]
            for a, b in zip(rows.bounds[:-1], rows.bounds[1:])]


def reference_best_fit_rooms(lengths: list[int], seq_len: int) -> list[int]:
    """Best-fit decreasing one piece at a time, by a linear scan of the rows: the room left in each row."""
    rooms: list[int] = []
    for n in sorted(lengths, reverse=True):
        fits = [i for i, room in enumerate(rooms) if room >= n]
        if fits:
            best = min(fits, key=lambda i: rooms[i])
            rooms[best] -= n
        else:
            rooms.append(seq_len - n)
    return sorted(rooms)


# ---- rows: which pieces of which samples each row holds ------------------------------------------------------

COUNTS, SEQ_LEN = [5, 20, 3, 2], 8  # the second sample is longer than seq_len


def test_truncate_keeps_each_samples_head_and_in_order_packs_in_data_order():
    padded = packing.layout_rows(COUNTS, SEQ_LEN, packing=False)
    assert row_pieces(padded) == [[(0, 0, 5)], [(1, 0, 8)], [(2, 0, 3)], [(3, 0, 2)]]
    packed = packing.layout_rows(COUNTS, SEQ_LEN, packing=True)
    assert row_pieces(packed) == [[(0, 0, 5)], [(1, 0, 8)], [(2, 0, 3), (3, 0, 2)]]
    # Today's boundaries, unchanged: rows of whole samples in order.
    assert packing.row_bounds(COUNTS, SEQ_LEN, packing=True).tolist() == packed.bounds.tolist()


def test_split_cuts_long_samples_into_seq_len_pieces_laid_out_as_samples():
    padded = packing.layout_rows(COUNTS, SEQ_LEN, packing=False, overflow="split")
    assert row_pieces(padded) == [[(0, 0, 5)], [(1, 0, 8)], [(1, 8, 8)], [(1, 16, 4)], [(2, 0, 3)], [(3, 0, 2)]]
    packed = packing.layout_rows(COUNTS, SEQ_LEN, packing=True, overflow="split")
    assert row_pieces(packed) == [[(0, 0, 5)], [(1, 0, 8)], [(1, 8, 8)], [(1, 16, 4), (2, 0, 3)], [(3, 0, 2)]]


def test_drop_leaves_out_every_sample_longer_than_seq_len():
    padded = packing.layout_rows(COUNTS, SEQ_LEN, packing=False, overflow="drop")
    assert row_pieces(padded) == [[(0, 0, 5)], [(2, 0, 3)], [(3, 0, 2)]]
    packed = packing.layout_rows(COUNTS, SEQ_LEN, packing=True, overflow="drop")
    assert row_pieces(packed) == [[(0, 0, 5), (2, 0, 3)], [(3, 0, 2)]]


# Samples of 3, 10, 6 and 12 tokens at seq_len 8, with their assistant masks; counted by hand below. A sample's first
# token is never a label (each row's sequence starts there), so labels are the masked positions from 1 on.
CUT_COUNTS = [3, 10, 6, 12]
CUT_MASKS = [[0, 1, 1],  # labels at 1, 2
             [0, 0, 0, 1, 1, 1, 1, 1, 1, 1],  # labels at 3..9: 8 and 9 past seq_len
             [1, 1, 1, 0, 0, 0],  # labels at 1, 2 (0 is the first token)
             [0] * 9 + [1, 1, 1]]  # labels at 9, 10, 11: all past seq_len


@pytest.mark.parametrize("overflow, samples, tokens, labels_cut", [
    ("truncate", 2, 2 + 4, 2 + 3),  # the tails 8..9 and 8..11
    ("drop", 2, 10 + 12, 7 + 3),  # the two long samples whole
    ("split", 0, 0, 1),  # each second piece's first token (position 8): labelled in sample 1 only
])
def test_cut_counts_what_overflow_leaves_out_by_hand(overflow, samples, tokens, labels_cut):
    import pyarrow as pa

    masks = pa.chunked_array([pa.array(CUT_MASKS[:1], pa.list_(pa.int8())),  # two chunks, as Arrow may hold them
                              pa.array(CUT_MASKS[1:], pa.list_(pa.int8()))])
    cut = packing.cut(CUT_COUNTS, 8, overflow, masks)
    assert (cut.samples, cut.tokens, cut.label_tokens, cut.labels_total) == (samples, tokens, labels_cut, 14)
    assert cut.label_fraction() == pytest.approx(labels_cut / 14)
    sliced = pa.chunked_array([pa.array(CUT_MASKS, pa.list_(pa.int8())).slice(1)])  # a chunk that is a slice
    # Sample 0 left out: none of its labels is ever cut.
    assert packing.cut(CUT_COUNTS[1:], 8, overflow, sliced).label_tokens == labels_cut


@pytest.mark.parametrize("overflow, samples, tokens, labels_cut", [
    ("truncate", 2, 2 + 4, 2 + 4),  # every token but a sample's first is a label
    ("drop", 2, 10 + 12, 9 + 11),
    ("split", 0, 0, 1 + 1),
])
def test_cut_counts_every_token_as_a_label_without_masks(overflow, samples, tokens, labels_cut):
    cut = packing.cut(CUT_COUNTS, 8, overflow)
    assert (cut.samples, cut.tokens, cut.label_tokens, cut.labels_total) == (samples, tokens, labels_cut,
                                                                             2 + 9 + 5 + 11)


def test_cut_counts_in_bounded_slices(monkeypatch):
    import pyarrow as pa

    masks = pa.chunked_array([pa.array(CUT_MASKS, pa.list_(pa.int8()))])
    whole = packing.cut(CUT_COUNTS, 8, "truncate", masks)
    monkeypatch.setattr(packing, "_CUT_SAMPLES_PER_SLICE", 1)
    assert packing.cut(CUT_COUNTS, 8, "truncate", masks) == whole


def test_a_trials_data_columns_say_what_truncation_cut(tmp_path, chat_file, chat_tokenizer, chat_tokens):
    """The row's cut columns over the real chat data, against an independent count of its tokens and labels."""
    spec = DataSpec(source="hf", path=str(chat_file), format="messages", loss_on="assistant")
    ref = tokenized.prepare(spec, str(chat_tokenizer), tmp_path)
    cached = tokenized.load(ref.path)
    seq_len = 16
    trial = packing.for_trial(ref, seq_len, spec, tokenized.lengths(cached), cached.data.column("assistant_masks"))
    longer = [(ids, mask) for ids, mask in chat_tokens if len(ids) > seq_len]
    labels = sum(sum(mask[1:]) for _, mask in chat_tokens)
    lost = sum(sum(mask[seq_len:]) for _, mask in longer)
    assert longer and lost
    row = trial.row_fields()
    assert (row["samples_cut"], row["tokens_cut"], row["label_tokens_cut"]) == (
        len(longer), sum(len(ids) - seq_len for ids, _ in longer), lost)
    assert row["label_tokens_cut_frac"] == pytest.approx(lost / labels)
    assert "of the label tokens" in trial.cut_note()


def test_best_fit_puts_each_piece_in_the_fullest_row_that_holds_it():
    rows = packing.layout_rows(COUNTS, SEQ_LEN, packing=True, overflow="split", pack_order="best_fit")
    # Longest first: 8, 8 fill two rows; 5 opens a third (room 3), 4 a fourth (room 4); 3 goes to the row with
    # room 3, not 4; 2 to the row with room 4.
    assert row_pieces(rows) == [[(1, 0, 8)], [(1, 8, 8)], [(0, 0, 5), (2, 0, 3)], [(1, 16, 4), (3, 0, 2)]]
    truncated = packing.layout_rows([6, 5, 2, 3, 1], 8, packing=True, pack_order="best_fit")
    assert row_pieces(truncated) == [[(0, 0, 6), (2, 0, 2)], [(1, 0, 5), (3, 0, 3)], [(4, 0, 1)]]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("overflow", ["truncate", "split"])
def test_best_fit_places_every_piece_once_in_fewer_rows_than_in_order(seed, overflow):
    rng = np.random.default_rng(seed)
    seq_len = 512
    counts = rng.integers(1, 700, size=3000)
    best = packing.layout_rows(counts, seq_len, packing=True, overflow=overflow, pack_order="best_fit")
    in_order = packing.layout_rows(counts, seq_len, packing=True, overflow=overflow)
    # The same pieces, each exactly once: best_fit only reorders them.
    assert sorted(zip(best.sample.tolist(), best.start.tolist(), best.length.tolist())) == \
        sorted(zip(in_order.sample.tolist(), in_order.start.tolist(), in_order.length.tolist()))
    filled = np.add.reduceat(best.length, best.bounds[:-1])
    assert filled.max() <= seq_len and (np.diff(best.bounds) > 0).all()
    assert len(best) <= len(in_order)
    again = packing.layout_rows(counts, seq_len, packing=True, overflow=overflow, pack_order="best_fit")
    assert again.bounds.tolist() == best.bounds.tolist() and again.sample.tolist() == best.sample.tolist()


def test_best_fit_is_exactly_best_fit_decreasing():
    """Placing pieces of one length together gives the rows a piece-by-piece best fit gives (rooms compared, as
    rows of equal room are interchangeable), empty pieces and full rows included."""
    rng = np.random.default_rng(7)
    for _ in range(500):
        seq_len = int(rng.integers(1, 40))
        lengths = rng.integers(0, seq_len + 1, size=int(rng.integers(0, 30)))
        order, bounds = packing.best_fit_decreasing(lengths, seq_len)
        assert sorted(order.tolist()) == list(range(len(lengths)))
        rooms = [seq_len - int(lengths[order[a:b]].sum()) for a, b in zip(bounds[:-1], bounds[1:])]
        assert sorted(rooms) == reference_best_fit_rooms(lengths.tolist(), seq_len)
    # Best-fit decreasing is not next fit's superior on every order: these pack in order into three full rows.
    adversarial = [16, 9, 8, 4, 13, 2, 8, 2, 9, 4]
    assert len(packing.layout_rows(adversarial, 25, packing=True)) == 3
    assert len(packing.layout_rows(adversarial, 25, packing=True, pack_order="best_fit")) == 4


def test_packing_efficiency_follows_the_layout():
    total = sum(COUNTS)  # 30 tokens, 18 of them left after truncation
    assert packing.packing_efficiency(COUNTS, SEQ_LEN, True) == pytest.approx(18 / (3 * 8))
    assert packing.packing_efficiency(COUNTS, SEQ_LEN, True, overflow="split") == pytest.approx(total / (5 * 8))
    assert packing.packing_efficiency(COUNTS, SEQ_LEN, True, "split", "best_fit") == pytest.approx(total / (4 * 8))
    assert packing.packing_efficiency(COUNTS, SEQ_LEN, False, "split") == pytest.approx(total / (6 * 8))
    ref = TokenizedData(key="k", path="p", cache="hit", build_s=None, name="n", data_hash="h", samples=4,
                        tokens_mean=7.5, tokens_max=20, pad_id=0)
    spec = DataSpec(source="hf", path="p", overflow="split", pack_order="best_fit", pad_to="longest")
    # pad_to narrows the batches, not the measure: rows count seq_len wide.
    assert packing.for_trial(ref, SEQ_LEN, spec, np.array(COUNTS)).packing_efficiency == pytest.approx(30 / 32)


# ---- batches over a real cache ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache as prepare writes it (save_to_disk), of samples 0..n-1 offset per sample: every token says where
    it came from (sample * 100 + position)."""
    import datasets

    samples = [[i * 100 + j for j in range(n)] for i, n in enumerate(COUNTS)]
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))})
    path = tmp_path_factory.mktemp("layout") / "cache"
    datasets.Dataset.from_dict({"input_ids": samples}, features=features).save_to_disk(str(path))
    return str(path), samples


@pytest.mark.parametrize("pack_order", ["in_order", "best_fit"])
def test_split_pieces_join_back_into_whole_samples(cache, pack_order):
    path, samples = cache
    rows = data.TokenRows(path, SEQ_LEN, packing=True, overflow="split", pack_order=pack_order)
    pieces: dict[int, list[tuple[int, list[int]]]] = {}
    for r in range(len(rows)):
        for tokens, loss in rows[r]:
            assert loss is None and len(tokens) <= SEQ_LEN
            pieces.setdefault(int(tokens[0]) // 100, []).append((int(tokens[0]) % 100, tokens.tolist()))
    assert {i: [t for _, part in sorted(parts) for t in part] for i, parts in pieces.items()} == dict(
        enumerate(samples))


def test_each_split_piece_starts_a_sequence_of_its_own(cache):
    path, _ = cache
    rows = data.TokenRows(path, SEQ_LEN, packing=True, overflow="split")
    batch = data.collate_rows([rows[r] for r in range(len(rows))], SEQ_LEN, 0, packing=True, varlen=True)
    # Row 3 holds sample 1's last piece (tokens 116..119) then sample 2 (200..202): positions restart at each.
    assert batch["input_ids"][3].tolist() == [116, 117, 118, 119, 200, 201, 202, 0]
    assert batch["position_ids"][3].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert batch["labels"][3].tolist() == [IGNORE, 117, 118, 119, IGNORE, 201, 202, IGNORE]
    assert batch["labels"][2].tolist() == [IGNORE] + list(range(109, 116))  # the middle piece
    assert batch[data.NONPAD_TOKENS] == sum(COUNTS)


def test_pad_to_longest_makes_each_batch_as_wide_as_its_longest_row_rounded_up():
    a, b, c = np.arange(1, 6), np.arange(1, 12), np.arange(1, 4)
    padded = data.collate_rows([[(a, None)], [(b, None)]], 32, 0, packing=False, varlen=False, pad_to="longest",
                               pad_multiple=8)
    assert padded["input_ids"].shape == (2, 16)  # 11 rounded up to 16
    assert padded["attention_mask"].sum(1).tolist() == [5, 11] and padded[data.NONPAD_TOKENS] == 16
    assert (padded["labels"][0, 5:] == IGNORE).all() and padded["labels"][1, 1:11].tolist() == b[1:].tolist()
    packed = data.collate_rows([[(a, None), (c, None)], [(c, None)]], 32, 0, packing=True, varlen=True,
                               pad_to="longest")
    assert packed["input_ids"].shape == packed["position_ids"].shape == (2, 8)  # the packed row's 5 + 3
    assert packed["position_ids"][1].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]  # its padded tail, a sequence of its own
    assert packed["cu_seq_lens_q"].tolist() == [0, 5, 8, 11, 16] and "attention_mask" not in packed
    # Never above seq_len: 27 tokens rounded up to 32 would be.
    assert data.collate_rows([[(np.arange(27), None)]], 30, 0, packing=False, varlen=False, pad_to="longest",
                             pad_multiple=8)["input_ids"].shape == (1, 30)
    assert [data.batch_width(n, 30, "longest", 8) for n in (1, 8, 9, 24, 25)] == [8, 8, 16, 24, 30]
    assert data.batch_width(3, 30) == 30


@pytest.mark.parametrize("packing", [True, False])
def test_the_loader_builds_batches_of_the_trials_layout(cache, packing):
    """The trial's data fields reach the loader: pad_to longest batches of split pieces, their token counts
    (what tokens_per_step and nonpad_tokens_per_step sum) taken from the batches themselves."""
    path, _ = cache
    config = TrialConfig.model_validate({
        "model": {"preset": "tiny"}, "train": {"seq_len": SEQ_LEN, "micro_batch": 2},
        "data": {"source": "hf", "path": path, "packing": packing, "overflow": "split", "pad_to": "longest",
                 "pad_multiple": 2, "pack_order": "best_fit" if packing else "in_order"}})
    ref = TokenizedData(key="k", path=path, cache="hit", build_s=None, name="cache", data_hash="h",
                        samples=len(COUNTS), tokens_mean=7.5, tokens_max=20, pad_id=-1)
    loader = data.batches(config, model_shape(config), rank=0, world_size=1, ref=ref)
    rows = 4 if packing else 6  # best fit: [8], [8], [5, 3], [4, 2]; padded: one piece each
    epoch = [next(loader) for _ in range(rows // 2)]
    assert sum(b[data.NONPAD_TOKENS] for b in epoch) == sum(COUNTS)  # every token of the data, once
    for batch in epoch:
        filled = batch["input_ids"].ne(-1).sum(1)  # pad_id -1 is no token of the data
        assert batch["input_ids"].shape[1] == min(SEQ_LEN, -(-int(filled.max()) // 2) * 2)
        assert batch[data.NONPAD_TOKENS] == int(filled.sum())
        assert ("position_ids" in batch) == packing


# ---- the spec: refusals, trial ids --------------------------------------------------------------------------

def hf_sweep(chat_file, chat_tokenizer, **data_fields) -> dict:
    return {"name": "layout", "model": {"preset": "tiny"},
            "data": {"source": "hf", "path": str(chat_file), "tokenizer": str(chat_tokenizer), "format": "messages",
                     **data_fields}}


@pytest.mark.parametrize("fields, field", [({"pad_multiple": 8}, "data.pad_multiple"),
                                           ({"packing": False, "pack_order": "best_fit"}, "data.pack_order")])
def test_an_option_without_the_one_it_needs_is_refused(chat_file, chat_tokenizer, fields, field):
    with pytest.raises(ConfigError) as err:
        parse_sweep(hf_sweep(chat_file, chat_tokenizer, **fields))
    assert [p.field for p in err.value.problems] == [field]
    assert "data.pad_to: longest" in str(err.value) or "data.packing: true" in str(err.value)


def test_an_axis_that_unsets_what_an_option_needs_is_refused(tmp_path, chat_file, chat_tokenizer, capsys):
    import yaml

    raw = hf_sweep(chat_file, chat_tokenizer, pack_order="best_fit")
    raw["axes"] = {"data.packing": [True, False]}
    with pytest.raises(ConfigError) as err:
        plan(parse_sweep(raw))
    assert [p.field for p in err.value.problems] == ["data.pack_order"]
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump(raw))
    assert cli.main(["validate", str(sweep)]) == 2
    assert "data.pack_order" in capsys.readouterr().err
    raw["exclude"] = [{"data.packing": False}]
    assert [t.config.data.pack_order for t in plan(parse_sweep(raw))] == ["best_fit"]


def test_layout_options_need_hf_data():
    with pytest.raises(ConfigError) as err:
        parse_sweep({"name": "x", "model": {"preset": "tiny"}, "data": {"pad_to": "longest"}})
    assert [p.field for p in err.value.problems] == ["data.pad_to"]


def test_hf_trials_keep_their_ids_until_a_layout_option_is_set():
    """Trial ids hash the dumped config: the layout fields are left out at their defaults (stored rows, resumes)."""
    def hf_id(**fields) -> str:
        return config_id(TrialConfig.model_validate({"model": {"preset": "tiny"}, "data": {
            "source": "hf", "path": "/data/chat.jsonl", "tokenizer": "/tok", "format": "messages", **fields}}))

    assert hf_id() == "bdb07d9405a9ffc4"  # the id before the layout fields existed
    assert hf_id(overflow="truncate", pack_order="in_order", pad_to="seq_len", pad_multiple=1) == hf_id()
    changed = [hf_id(overflow="split"), hf_id(pack_order="best_fit"), hf_id(pad_to="longest"),
               hf_id(pad_to="longest", pad_multiple=8)]
    assert len({hf_id(), *changed}) == 5
    dumped = DataSpec(source="json", path="/data/a.json").model_dump()
    assert not {"overflow", "pack_order", "pad_to", "pad_multiple"} & set(dumped)


def test_layout_is_the_loaders_not_the_caches(chat_file, chat_tokenizer):
    spec = DataSpec(source="hf", path=str(chat_file), format="messages")
    other = DataSpec(source="hf", path=str(chat_file), format="messages", overflow="split", pack_order="best_fit",
                     pad_to="longest", pad_multiple=8)
    hashed = tokenized.data_hash(str(chat_file))
    assert tokenized.cache_key(spec, str(chat_tokenizer), hashed) == tokenized.cache_key(other, str(chat_tokenizer),
                                                                                          hashed)
    assert tokenized.spec_key(spec, None) == tokenized.spec_key(other, None)


def test_batches_are_torch_tensors_of_the_narrowed_width():
    batch = data.collate_rows([[(np.arange(1, 4), None)]], 16, 0, packing=False, varlen=False, pad_to="longest")
    assert isinstance(batch["input_ids"], torch.Tensor) and batch["input_ids"].shape == (1, 3)
    assert "attention_mask" not in batch  # a full row needs no mask
