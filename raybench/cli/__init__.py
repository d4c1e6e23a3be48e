"""Layer 7, entry points: the `raybench` command line, a thin layer over the drivers, the rehearsal and the reports.

`main` (argument parsing, exit codes, every command), `results` (report, compare, losses, export), `store` (query,
compact). Handlers parse arguments, call the module that owns the work, print, and return the exit code. Heavy
libraries load per command, so `raybench validate` starts nothing.
"""
