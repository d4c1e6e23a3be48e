"""How long checking every record of a 16 MB chat file takes before launch (data.records, at `validate`).

    .venv/bin/python bench/record_check.py [--mib 16] [--repeats 3]

Writes a JSON Lines file of chat conversations (format messages) of about --mib MiB in a temporary directory,
then times records.problems (every record streamed and checked) and tokenized.problems (that, and the first
record read with datasets and rendered by the tokenizer: the whole data check `validate` runs). Prints a table,
then one JSON line: value = median seconds of records.problems.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' tiny chat tokenizer and conversations

from raybench.data import records, tokenized  # noqa: E402
from raybench.spec.sweep_spec import DataSpec  # noqa: E402
from tests.conftest import chat_records, make_chat_tokenizer  # noqa: E402


def write_chat_file(path: Path, mib: float) -> int:
    """Conversations repeated until the file holds `mib` MiB; returns the record count."""
    lines = [json.dumps(r) + "\n" for r in chat_records(64)]
    count, size = 0, 0
    with open(path, "w") as f:
        while size < mib * 2**20:
            line = lines[count % len(lines)]
            f.write(line)
            size += len(line)
            count += 1
    return count


def median_s(function, repeats: int) -> tuple[float, float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        found = function()
        times.append(time.perf_counter() - t0)
        assert found == [], found
    return statistics.median(times), max(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=float, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "chat.jsonl"
        count = write_chat_file(path, args.mib)
        tokenizer = str(make_chat_tokenizer(Path(scratch) / "tok"))
        spec = DataSpec(source="hf", path=str(path), format="messages", loss_on="assistant")
        every_record = median_s(lambda: records.problems(spec), args.repeats)
        whole_check = median_s(lambda: tokenized.problems(spec, tokenizer), args.repeats)
        size_mib = path.stat().st_size / 2**20
    print(f"{size_mib:.1f} MiB, {count} records")
    print(f"{'check':<28}{'median s':>10}{'max s':>10}")
    for name, (med, worst) in (("records.problems", every_record), ("tokenized.problems", whole_check)):
        print(f"{name:<28}{med:>10.2f}{worst:>10.2f}")
    print(json.dumps({"bench": "record_check", "metric": "seconds to check every record of a chat JSONL file",
                      "value": round(every_record[0], 2), "mib": round(size_mib, 1), "records": count,
                      "whole_data_check_s": round(whole_check[0], 2)}))


if __name__ == "__main__":
    main()
