"""Layer 2, data preparation: a sweep's real data, from the user's files to the rows its ranks read.

`prepare` (the one call the sweep's driver makes, before any trial starts: each data spec tokenized once, each
layout laid out once, in the store's cache), `records` (every record checked before launch: the plan calls it),
`tokenized` (hf data tokenized once into the cache), `json_rows` (JSON data's rows per layout), `packing` (which
samples or pieces each row holds, and what the overflow cuts: the driver before launch, every rank alike).
Imports `spec` only: the plan checks the data with it, the driver prepares it, the runtime reads its rows. No Ray;
datasets, transformers, numpy and pyarrow load on first use.
"""
