"""The shipped smoke sweep run as a user runs it, in a real terminal (tmux, WIDTHxHEIGHT), and the screens it
showed: the first that lists running trials, the one at the end. The same capture tests/integration/test_ray_sweep.py
asserts on; this keeps what a person sees for docs/results.

    PYTHONPATH=$PWD .venv/bin/python bench/terminal_screens.py [WIDTH HEIGHT]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from tests import terminal

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    width, height = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (100, 30)
    tmp = Path(tempfile.mkdtemp())
    shutil.copy(REPO / "sweeps" / "smoke-cpu.yaml", tmp / "smoke-cpu.yaml")
    seen = terminal.run_in_tmux([sys.executable, "-m", "raybench", "run", str(tmp / "smoke-cpu.yaml"), "--store",
                                 str(tmp / "store")], tmp, width=width, height=height)
    running = next((s for s in seen.screens if " running " in s and "trials  ok" in s and "-r0" in s), None)
    print(f"exit code {seen.exit_code}, {len(seen.screens)} distinct screens captured, terminal {width}x{height}")
    for title, screen in (("a screen while trials ran", running), ("the screen at the end", seen.final)):
        print(f"\n--- {title} ---\n" + ("(none captured)" if screen is None else screen.rstrip()))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
