"""A script of bench/ loaded as a module in a test (bench/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load(path: Path):
    """The file at `path` as a module, registered under its stem first (a dataclass it defines looks its module up
    in sys.modules), with its folder on the path for the sibling modules it imports."""
    if str(path.parent) not in sys.path:  # its sibling modules, as Python finds them for a script
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module
