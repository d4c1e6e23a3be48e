"""Every trial id of every shipped sweep (sweeps/ and bench/sweeps/), planned with invalid points kept, as JSON:
run it at two commits from the same checkout path (ids of stacks that name files hold their absolute paths) and
compare the files to show that a change left trial ids alone.

    PYTHONPATH=$PWD .venv/bin/python bench/trial_ids.py OUT.json
"""

from __future__ import annotations

import glob
import json
import sys

from raybench.planning.plan import plan
from raybench.spec.load import load_sweep


def main(out: str) -> None:
    ids: dict[str, list[str] | str] = {}
    for path in sorted(glob.glob("sweeps/*.yaml") + glob.glob("bench/sweeps/*.yaml")):
        try:
            ids[path] = sorted(t.trial_id for t in plan(load_sweep(path), keep_invalid=True))
        except Exception as err:  # a sweep that needs files made elsewhere (a GPU round's data) is listed as such
            ids[path] = f"unplannable here: {type(err).__name__}"
    with open(out, "w") as f:
        json.dump(ids, f, indent=0)
    planned = [v for v in ids.values() if isinstance(v, list)]
    print(f"{len(ids)} sweep files, {len(planned)} planned, {sum(map(len, planned))} trial ids")


if __name__ == "__main__":
    main(sys.argv[1])
