"""Layer 2, results: the Parquet store and everything that reads it.

`store` (one file per trial attempt, atomic, versioned schema), `compaction`, `query` (DuckDB SQL), `frames`
(pandas views), `report` and `report_files` with `plots`, `compare` (systems side by side), `export`
(MLflow, W&B), `best` (best configuration per GPU type from stored rows), `schema_doc` (docs/schema.md).
Imports only `spec`; never torch (the store) and never Ray.
"""
