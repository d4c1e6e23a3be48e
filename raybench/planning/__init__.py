"""Layer 3, planning: from a sweep spec to planned trials, before anything starts.

`plan` (grid expansion, cross-field rules, content-hash trial ids, pruning; each trial's `spec.payload.TrialPayload`),
`estimate` (analytic memory and step-time), `assessment` (the estimate judged against the device memory: the
`Assessment` a payload carries as plain data and a row stores), `calibration` (what the store tells the plan:
measured peaks, rehearsals). Imports `spec`, `results` (stored rows calibrate the plan) and `data` (the data's
records checked before launch); no torch, no Ray. The plan's tables are
raybench.reports.tables.
"""
