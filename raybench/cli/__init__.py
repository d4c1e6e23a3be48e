"""Layer 6, entry points: the `raybench` command line, a thin layer over the drivers and the results.

`main` (argument parsing, exit codes, every command), `results` (report, compare, export), `store` (query,
compact). Heavy libraries load per command, so `raybench validate` starts nothing.
"""
