"""Layer 1, facts and the sweep spec: what a sweep file may say and what its values mean.

The typed spec (`sweep_spec`; the settings part of no trial in `sweep_settings`; every section's base in
`section`), its checks (`validate`), YAML loading (`load`) and the errors every bad input raises (`errors`);
value parsing (`values`: sAC ratios, env names), sAC placement (`sac`), axis semantics (`axes`); facts about
hardware and models (`hardware`, `presets`); the result row's columns (`schema`) and the pure metric math
(`metrics`, `stats`); secrets out of text (`redact`); the generated sweep reference (`reference`); the contract
between the plan and a trial's ranks: the `TrialPayload` (`payload`) and the tokenized data's handle
(`tokenized_data`, which opens a cache entry with `datasets` on first use). Imports no other layer, and no torch
or Ray; pyarrow only inside `tokenized_data`'s functions.
"""
