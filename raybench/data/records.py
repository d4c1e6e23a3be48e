"""Every record of real data (data.source: hf) checked before launch, and a data directory of one format.

`datasets` reads a directory in one format only (the most common one), so a directory of JSON Lines and Parquet
files would train on part of its records while the data hash covers them all: refused (`format_problem`).

`problems` streams every record of the split, file by file in the order datasets reads them, and checks what
data.format needs of it (the text, the messages, the Alpaca fields), so that a bad record deep in a large file is
caught at `validate`, not by a build that fails after launch. Each problem names its file and line (JSON Lines,
CSV) or record (JSON arrays, Parquet, Arrow, a saved dataset); the check stops at the first MAX_PROBLEMS. Only
the first data.max_samples records are checked for content (the rest are never tokenized), but every JSON line
must parse: datasets reads whole files. A problem with the split's very first record is most likely the wrong
column or format, and is said so (`column_problem`).
"""

from __future__ import annotations

import csv
import itertools
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from raybench.spec.errors import Problem
from raybench.spec.sweep_spec import DataSpec
from raybench.spec.tokenized_data import offline_datasets

MAX_PROBLEMS = 10
# The record formats datasets reads from a directory, by suffix (its own table also maps .md, .txt and media files,
# which a dataset repository holds as its card, licence or attachments).
FORMATS = {".json": "json", ".jsonl": "json", ".ndjson": "json", ".parquet": "parquet", ".arrow": "arrow",
           ".csv": "csv", ".tsv": "csv"}
BATCH_ROWS = 1024  # Arrow-backed files are read this many records at a time


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / f).is_file() for f in ("dataset_dict.json", "state.json"))


def format_problem(data: DataSpec) -> Problem | None:
    """A data directory whose record files are of more than one format (datasets would read only one)."""
    path = Path(data.path)
    if not path.is_dir() or is_saved_dataset(path):
        return None
    ignored = offline_datasets().data_files.FILES_TO_IGNORE  # a repository's card and metadata, never records
    by_format: dict[str, list[str]] = {}
    for file in sorted(path.rglob("*")):
        relative = file.relative_to(path)
        if (file.is_file() and file.suffix in FORMATS and file.name not in ignored
                and not any(p.startswith(".") for p in relative.parts)):
            by_format.setdefault(FORMATS[file.suffix], []).append(str(relative))
    if len(by_format) < 2:
        return None
    found = ", ".join(f"{name} ({len(files)} file(s): {', '.join(files[:3])}{', ...' if len(files) > 3 else ''})"
                      for name, files in sorted(by_format.items()))
    return Problem("data.path", data.path, f"holds record files of more than one format: {found}; datasets reads "
                   "one format of a directory and would leave the others out. Convert them to one format, move the "
                   "others out of the directory, or point data.path at one file")


def problems(data: DataSpec) -> list[Problem]:
    """A directory of one format, then every record of the split, streamed, up to MAX_PROBLEMS problems. Files it
    cannot list (an unknown split, an unreadable directory) give none here: reading the split reports those."""
    mixed = format_problem(data)
    if mixed is not None:
        return [mixed]
    found = []
    limit = data.max_samples if data.max_samples is not None else float("inf")
    for index, (where, record) in enumerate(_records(data, limit)):
        if isinstance(record, Problem):
            found.append(record)
        elif index < limit:
            if index == 0 and isinstance(record, dict) and (column := column_problem(record, data)) is not None:
                return [column]  # the wrong column or format: every record would say so
            why = record_problem(record, data)
            if why is not None:
                found.append(Problem("data.path", where, f"{why}; fix or remove this record"))
        if len(found) >= MAX_PROBLEMS:
            found.append(Problem("data.path", data.path, f"the check stopped at the first {MAX_PROBLEMS} problems; "
                                 "fix them and validate again"))
            break
    return found


def column_problem(rec: dict, data: DataSpec) -> Problem | None:
    """What the split's first record says about data.format and data.field: a missing column or one of the wrong
    kind is a setting to change, not a record to fix."""
    columns = ", ".join(rec) or "none"
    if data.format == "alpaca":
        if data.field is not None:
            return Problem("data.field", data.field, "alpaca records are read from instruction, input and output; "
                           "remove data.field")
        if not {"instruction", "output"} <= set(rec):
            return Problem("data.format", data.format, f"alpaca records need instruction and output columns; "
                           f"{data.path} has {columns}")
        return None
    field = text_field(data)
    if field not in rec:
        return Problem("data.field", data.field, f"no column '{field}' in {data.path} (its columns: {columns}); "
                       "set data.field")
    value = rec[field]
    if data.format == "text" and not isinstance(value, str):
        return Problem("data.field", field, f"holds {type(value).__name__}, not text; name a text column, or use "
                       "format: messages for conversations")
    if data.format == "messages" and not (isinstance(value, list) and value and all(
            isinstance(m, dict) and {"role", "content"} <= set(m) for m in value)):
        return Problem("data.field", field, "holds no list of {role, content} messages; name the messages column, "
                       "or use format: text")
    return None


def text_field(data: DataSpec) -> str:
    return data.field or ("messages" if data.format == "messages" else "text")


def record_problem(rec: Any, data: DataSpec) -> str | None:
    """Why one record cannot be rendered as data.format says, or None."""
    if not isinstance(rec, dict):
        return f"a JSON {type(rec).__name__}, not a record (an object of fields)"
    if data.format == "alpaca":
        for name in ("instruction", "output"):
            if not isinstance(rec.get(name), str):
                return _missing_or_kind(rec, name, "text", "alpaca")
        if rec.get("input") is not None and not isinstance(rec["input"], str):
            return f"'input' holds {type(rec['input']).__name__}, not text"
        return None
    field = text_field(data)
    value = rec.get(field)
    if data.format == "text":
        return None if isinstance(value, str) else _missing_or_kind(rec, field, "text", "text")
    if not isinstance(value, list) or not value:
        return _missing_or_kind(rec, field, "a non-empty list of {role, content} messages", "messages")
    for i, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), (str, list))):
            return f"'{field}' message {i} is {_short(message)}, not {{role: text, content: text}}"
    return None


def _missing_or_kind(rec: dict, name: str, wanted: str, fmt: str) -> str:
    if rec.get(name) is None:
        return f"no '{name}' (the record has: {', '.join(k for k, v in rec.items() if v is not None) or 'nothing'}); " \
               f"data.format {fmt} reads it from every record"
    return f"'{name}' holds {type(rec[name]).__name__} ({_short(rec[name])}), not {wanted}"


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


# ---- the split's records, streamed ---------------------------------------------------------------------------

def _records(data: DataSpec, limit: float) -> Iterator[tuple[str, Any]]:
    """(where, record) for the split's records in datasets' order, the first `limit` of them, and past those every
    line of JSON files still (datasets parses them whole); a record that does not parse is a Problem in its
    place. `where` is FILE:LINE for JSON Lines and CSV, FILE record N otherwise."""
    path = Path(data.path)
    if is_saved_dataset(path):
        yield from itertools.islice(_saved_records(path, data.split), limit if limit != float("inf") else None)
        return
    count = 0
    for file in _split_files(path, data.split):
        reader = {"json": _json_records, "parquet": _parquet_records, "arrow": _arrow_records,
                  "csv": _csv_records}.get(FORMATS.get(file.suffix, ""))
        if reader is None:  # a format raybench does not read itself: reading the split checks it
            return
        for item in reader(file):
            if count >= limit and reader is not _json_records:
                return
            count += 1
            yield item


def _split_files(path: Path, split: str) -> list[Path]:
    """The files datasets reads for the split, in its order (none where it cannot tell)."""
    if path.is_file():
        return [path] if split == "train" else []  # a single file is the split "train", as datasets names it
    datasets = offline_datasets()
    datasets.logging.set_verbosity_error()  # a repository without a dataset card is fine
    try:
        with tempfile.TemporaryDirectory(prefix="raybench-data-files-") as scratch:
            files = datasets.load_dataset_builder(str(path), cache_dir=scratch).config.data_files
    except Exception:  # mixed formats across splits, an unreadable directory: reading the split says which
        return []
    return [Path(f) for f in files.get(split, [])] if files else []


def _json_records(file: Path) -> Iterator[tuple[str, Any]]:
    with open(file, encoding="utf-8", errors="replace") as f:
        head = f.read(4096).lstrip()
    if head.startswith("["):  # a JSON array of records, read whole (datasets does too)
        try:
            records = json.loads(file.read_text(encoding="utf-8", errors="replace"))
        except json.JSONDecodeError as err:
            yield "", Problem("data.path", f"{file}:{err.lineno}", f"not JSON: {_reason(err)}; fix the file")
            return
        for n, record in enumerate(records, 1):
            yield f"{file} record {n}", record
        return
    with open(file, encoding="utf-8", errors="replace") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{file}:{line_no}", json.loads(line.strip())
            except json.JSONDecodeError as err:
                yield f"{file}:{line_no}", Problem("data.path", f"{file}:{line_no}", f"not JSON: {_reason(err)}; fix "
                                                   "or remove this line")


def _reason(err: json.JSONDecodeError) -> str:
    return f"{err.msg.removesuffix(' at')} at column {err.colno}"


def _csv_records(file: Path) -> Iterator[tuple[str, Any]]:
    with open(file, newline="", encoding="utf-8", errors="replace") as f:
        reader = csv.DictReader(f, delimiter="\t" if file.suffix == ".tsv" else ",")
        for record in reader:
            yield f"{file}:{reader.line_num}", record


def _batches_as_records(file: Path, batches) -> Iterator[tuple[str, Any]]:
    n = itertools.count(1)
    for batch in batches:
        for record in batch.to_pylist():
            yield f"{file} record {next(n)}", record


def _parquet_records(file: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    yield from _batches_as_records(file, pq.ParquetFile(file).iter_batches(batch_size=BATCH_ROWS))


def _arrow_records(file: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa

    with pa.memory_map(str(file)) as source:
        try:  # datasets' own Arrow files are IPC streams; others may be IPC files
            reader = pa.ipc.open_stream(source)
            batches = iter(reader)
        except pa.ArrowInvalid:
            source.seek(0)
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        yield from _batches_as_records(file, batches)


def _saved_records(path: Path, split: str) -> Iterator[tuple[str, Any]]:
    datasets = offline_datasets()
    saved = datasets.load_from_disk(str(path))
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            return  # reading the split names the ones there are
        saved = saved[split]
    n = itertools.count(1)
    for batch in saved.iter(batch_size=BATCH_ROWS):
        for values in zip(*batch.values()):
            yield f"{path} ({split}) record {next(n)}", dict(zip(batch, values))
