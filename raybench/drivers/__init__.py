"""Layer 5, drivers: what starts and drives trials, and the only place that imports Ray.

`api` (run_sweep, read_results), `sweep` (Ray Tune over planned trials), the Ray cluster's lifecycle,
`trial` (one trial through an executor into one stored row), `executors/` (warm pool, Ray Train, torchrun),
`search` (Optuna/random searchers), `progress` (the live view), `slurm` (sbatch, warm clusters).
The rehearsal (`raybench.rehearse`) sits beside this layer: it drives one rank's real step in one process.
"""
