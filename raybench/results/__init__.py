"""Layer 2, results: the Parquet store and what reads it below the reports.

`store` (one file per trial attempt, atomic, versioned schema), `compaction`, `query` (DuckDB SQL), `profiles`
(calibration profiles in the store), `schema_doc` (docs/schema.md from the store's schema). Imports only `spec`;
never torch (the store) and never Ray. What the command line shows of stored rows is raybench.reports.
"""
