"""The loader's share of a step on real chat data, by data.num_workers (0: batches built in the rank's process).

hf data is tokenized once; every batch is then built by the loader's collate function (samples truncated,
packed side by side, labels, position ids). With loader workers that work runs in other processes, ahead of the
step, and the step's `data` phase (phase_data_p50_s: waiting for the batch and copying it) shrinks. One rank,
a tiny Llama and many short conversations, so the per-batch work is a visible share of the step on a CPU.
Trials run interleaved (0 1 2 2 1 0 ...) under plain torchrun (`raybench trial`), one attempt each:
    .venv/bin/python bench/loader_workers.py [--rounds 3] [--workers 0 1 2] [--micro-batch 16] [--seq-len 512]
        [--hidden 64] [--layers 2] [--words-max 12]
Prints a table, then one JSON line: value = the data phase's share of the step (p50s) with the most workers
divided by that share with none. Goal < 0.5: workers take the batch building out of the step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly box jugs of liquid gold under pale "
         "moonlight and every model learns tokens fast").split()
TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s>{% endfor %}"
            "{% if add_generation_prompt %}<s> assistant :{% endif %}")


def make_data(root: Path, conversations: int, hidden: int, layers: int, words_max: int) -> tuple[Path, Path]:
    """A chat tokenizer and a tiny Llama in one directory, and JSON Lines of short conversations."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS) + " user assistant :"],
                            trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<s>", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = TEMPLATE
    model_dir = root / "model"
    fast.save_pretrained(model_dir)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64, max_position_embeddings=4096)
    LlamaForCausalLM(config).save_pretrained(model_dir, safe_serialization=True)

    def words(i: int, k: int) -> str:
        return " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(k))

    chat = root / "chat.jsonl"
    chat.write_text("\n".join(json.dumps({"messages": [
        {"role": "user", "content": words(i, 1 + i % words_max)},
        {"role": "assistant", "content": words(i + 1, 1 + (i * 5) % words_max)}]}) for i in range(conversations)))
    return model_dir, chat


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--conversations", type=int, default=20_000)
    parser.add_argument("--hidden", type=int, default=64, help="the model's width (the step's compute)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--words-max", type=int, default=12, help="longest turn in words (samples per row)")
    args = parser.parse_args()
    from raybench.results import store

    with tempfile.TemporaryDirectory(prefix="raybench-loader-") as tmp:
        root = Path(tmp)
        model_dir, chat = make_data(root, args.conversations, args.hidden, args.layers, args.words_max)
        sweep = root / "loader.yaml"
        sweep.write_text(json.dumps({
            "name": "loader-workers", "executor": "torchrun", "store": str(root / "store"),
            "model": {"path": str(model_dir)},
            "data": {"source": "hf", "path": str(chat), "format": "messages", "loss_on": "assistant",
                     "packing": True, "prefetch_factor": 4},
            "train": {"steps": args.steps, "warmup_steps": 3, "seq_len": args.seq_len,
                      "micro_batch": args.micro_batch, "precision": "fp32", "lr": 1e-3},
            "resources": {"workers": 1, "cpus_per_worker": 1},
            "axes": {"loader": [{"data.num_workers": w} if w else {"data.num_workers": 0, "data.prefetch_factor": None}
                                for w in args.workers]}}))
        order = []
        for r in range(args.rounds):  # interleaved, each direction in turn, so drift hits every setting alike
            order += list(range(len(args.workers)))[:: 1 if r % 2 == 0 else -1]
        for index in order:
            done = subprocess.run([sys.executable, "-m", "raybench", "trial", str(sweep), str(index)],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"trial {index} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        rows = store.read_results(root / "store", "loader-workers", latest=False)  # every attempt
        rows = rows[rows.status == "ok"]
        rows["share"] = rows.phase_data_p50_s / rows.step_time_p50_s
        print(f"{'num_workers':>11} {'trials':>6} {'data p50 ms':>12} {'step p50 ms':>12} {'data share':>10} "
              f"{'nonpad tok/s':>13}")
        shares = {}
        for w in args.workers:
            mine = rows[rows.data_num_workers == w]
            shares[w] = statistics.median(mine.share)
            print(f"{w:>11} {len(mine):>6} {statistics.median(mine.phase_data_p50_s) * 1e3:>12.2f} "
                  f"{statistics.median(mine.step_time_p50_s) * 1e3:>12.1f} {shares[w]:>10.3f} "
                  f"{statistics.median(mine.nonpad_tok_per_s):>13,.0f}")
        first = rows.sort_values("ended_at").iloc[0]
        print(f"data: {first.data_samples} conversations, {first.sample_tokens_mean:.1f} tokens mean, packing "
              f"efficiency {first.packing_efficiency:.3f}, tokenized once in {rows.data_build_s.max():.1f} s "
              f"({(rows.data_cache == 'hit').sum()} of {len(rows)} trials found it in the store)")
        most = max(args.workers)
        print(json.dumps({
            "bench": "loader_workers", "metric": f"data phase share of the step, num_workers {most} / 0",
            "value": round(shares[most] / shares[min(args.workers)], 4), "goal": "< 0.5",
            "share_by_workers": {str(w): round(s, 4) for w, s in shares.items()},
            "step_p50_ms_by_workers": {str(w): round(statistics.median(rows[rows.data_num_workers == w]
                                                                         .step_time_p50_s) * 1e3, 2)
                                       for w in args.workers},
            "data_build_s": round(float(rows.data_build_s.max()), 3), "packing_efficiency":
                round(float(first.packing_efficiency), 4), "config": vars(args)}))


if __name__ == "__main__":
    main()
