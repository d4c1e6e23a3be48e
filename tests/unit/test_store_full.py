"""The store's filesystem fills up (a real tmpfs of a few hundred KiB, mounted by the test as root): the row that
cannot be written fails loudly with its path and the free space, no torn or empty file is left, the rows written
before stay whole, and once space is freed the missing rows are written. The whole sweep's side (a `raybench run`
stopped by the full disk, then resumed) is tests/integration/test_faults_ray.py (`-m slow`)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from raybench.cli import main as cli
from raybench.results import store
from tests.tmpfs import fill, mounted_tmpfs

SWEEP = "full"


@pytest.fixture
def small_fs(tmp_path):
    """A 512 KiB tmpfs (about ten one-row files), unmounted afterwards."""
    with mounted_tmpfs(tmp_path / "store", "512k") as mount:
        yield mount


def row(trial_id: str) -> dict:
    return {"sweep": SWEEP, "trial_id": trial_id, "status": "ok", "tok_per_s": 1.0}


def every_file(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.name != "filler"]


def test_a_row_on_a_full_disk_fails_loudly_leaves_nothing_torn_and_fits_once_freed(small_fs):
    written = [store.write_row(small_fs, row(f"t{i}")) for i in range(2)]
    filler = fill(small_fs)
    with pytest.raises(store.StoreWriteError) as failed:
        store.write_row(small_fs, row("t2"))
    message = str(failed.value)
    # The file it could not write, the reason, and the space left where it tried.
    assert str(small_fs / f"sweep={SWEEP}") in message and "t2__" in message, message
    assert "No space left on device" in message and "MiB free of 0.5 MiB" in message, message
    assert sorted(every_file(small_fs)) == sorted(written)  # no temp file, empty or torn
    for path in written:  # an independent reader: each earlier file whole
        assert pq.read_table(path).column("trial_id").to_pylist() == [path.stem.split("__")[0]]
    filler.unlink()
    store.write_row(small_fs, row("t2"))
    assert sorted(store.read_table(small_fs, SWEEP).column("trial_id").to_pylist()) == ["t0", "t1", "t2"]


def test_run_on_a_full_store_exits_1_with_the_file_and_the_space_left(small_fs, tmp_path, capsys):
    # Both points are invalid (tp_size applies to tp only): their rows are written without starting Ray.
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"name: {SWEEP}\nmodel: {{preset: tiny}}\nstore: {small_fs}\naxes: {{train.tp_size: [3, 4]}}\n")
    filler = fill(small_fs)
    assert cli.main(["run", str(sweep), "--keep-invalid", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "cannot write the result file" in err and "MiB free" in err and "Traceback" not in err, err
    assert "run the same command again" in err
    assert every_file(small_fs) == []  # nothing half-written
    filler.unlink()
    cli.main(["run", str(sweep), "--keep-invalid", "--quiet"])
    assert sorted(pq.read_table(small_fs / f"sweep={SWEEP}").column("status").to_pylist()) == ["invalid"] * 2
