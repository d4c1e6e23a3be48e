"""What fabric the corpus's multi-node rows would need: each entry rehearsed as bench/rehearse_public.py does, once
with the corpus's assumption (one NIC per GPU) and once per smaller count of NICs a node
(`estimate.nics_per_node`), its predicted step against the published one. A what-if, not a fit: nothing in
raybench or the corpus changes with it.

    PYTHONPATH=$PWD .venv/bin/python bench/fabric_what_if.py [--nics 8 4 2 1] [--only ID ...]

Default entries: every expressible entry on more than one node whose source does not state its fabric.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import public_results  # bench/public_results.py
from rehearse_public import predict  # bench/rehearse_public.py


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nics", type=int, nargs="*", default=[8, 4, 2, 1], help="NICs a node to try")
    parser.add_argument("--only", nargs="*", help="entry ids (default: multi-node entries of unstated fabric)")
    args = parser.parse_args()
    chosen = [e for e in public_results.load() if e.not_expressible is None and (
        e.id in args.only if args.only else e.nodes > 1 and e.interconnect == "not stated")]
    traces: dict = {}
    with tempfile.TemporaryDirectory() as store:
        for entry in chosen:
            line = {"id": entry.id, "set": "seen" if entry.seen else "unseen", "nodes": entry.nodes,
                    "published_step_s": round(entry.published_step_s, 3)}
            for nics in args.nics:
                row = predict(entry, store, traces, {"nics_per_node": nics})
                line[f"step_err_{nics}_nics"] = row.get("step_err")
                line[f"comm_s_{nics}_nics"] = row.get("comm_s")
                line[f"exposed_comm_s_{nics}_nics"] = row.get("exposed_comm_s")
            line["compute_s"] = row.get("compute_s")
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
