"""Layer 6, reports: what the command line shows of plans, rehearsals and stored results, beside the cli (only the
cli imports it).

`report` (text tables: the renderer every table uses, stored rows, query results), `tables` (the plan, estimate
and rehearsal tables), `frames` (pandas views of stored rows), `report_files` with `plots` (Markdown/HTML/PNG
reports and their figures), `compare` (systems side by side), `export` (MLflow, W&B), `best` (best configuration
per GPU type from stored rows; `run`'s closing report), `losses` (loss by step against a baseline), `prediction`
(`best --predict`), `device_profile` (`calibrate`'s profile), `cluster_health` (the report's pre-flight section). Imports the layers below it but never the drivers, so never Ray;
heavy libraries (pandas, matplotlib, the trackers) load only in the modules that draw or export.
"""
