"""docs/schema.md is generated from store.SCHEMA: it must be current, and every column must say what it means."""

from pathlib import Path

import pyarrow as pa

from raybench.results import schema_doc, store

REPO = Path(__file__).resolve().parents[2]


def test_schema_page_is_current():
    assert (REPO / "docs" / "schema.md").read_text() == schema_doc.render(), (
        "regenerate: python -m raybench.results.schema_doc > docs/schema.md")


def test_every_column_is_described_once():
    assert schema_doc.undescribed() == [], "add the new columns' meanings to raybench/schema_doc.DESCRIPTIONS"
    page = schema_doc.render()
    for name in store.SCHEMA.names:
        assert page.count(f"| `{name}` |") == 1, name


def test_units_follow_names():
    assert schema_doc.unit_of("step_time_p50_s", pa.float64()) == "s"
    assert schema_doc.unit_of("peak_reserved_gib_by_rank", pa.list_(pa.float64())) == "GiB"
    assert schema_doc.unit_of("tok_per_s_per_device", pa.float64()) == "tokens/s per device"
    assert schema_doc.unit_of("gpu_power_limit_w", pa.float64()) == "W"
    assert schema_doc.unit_of("status", pa.string()) == ""
    assert schema_doc.type_name(pa.list_(pa.int32())) == "list<int32>"
