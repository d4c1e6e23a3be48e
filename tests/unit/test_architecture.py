"""The package's shape: `import raybench` stays cheap, and no module reaches into another's private names.
(The layer and Ray/torch contracts themselves are checked by `lint-imports`, configured in pyproject.toml.)"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "raybench"


def test_import_raybench_loads_no_pyarrow_torch_or_ray():
    code = "import sys, raybench; print(sorted(m for m in ('pyarrow', 'torch', 'ray', 'pandas', 'optuna') " \
           "if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    # ... and the public API is still there, loaded on first use.
    code = "import raybench; print(raybench.load_sweep.__module__, raybench.run_sweep.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["raybench.spec.load", "raybench.drivers.api"]


# Private Ray APIs raybench relies on (Ray is pinned): each behind one function, and pinned by a test of its own.
ALLOWED_PRIVATE = {
    # The GCS placement-group table with each group's creator, which no public API returns
    # (release_orphaned_placement_groups; test_faults_ray.py::test_ended_ray_train_trials_leave_...).
    "train.py: ray._private.state",
}


def test_no_module_imports_another_modules_private_names():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("raybench", "ray", "optuna"):
                offenders += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ray._private"):
                offenders.append(f"{path.name}: {node.module}")
    assert sorted(set(offenders) - ALLOWED_PRIVATE) == []


def import_cycles(package: str) -> list[list[str]]:
    """The package's import cycles (function-level imports included), each as its modules sorted: the strongly
    connected components of the import graph with more than one module."""
    import grimp  # import-linter's graph builder

    graph = grimp.build_graph(package)
    cycles = []
    for module in sorted(graph.modules):
        if any(module in cycle for cycle in cycles):
            continue
        cycle = sorted(m for m in graph.find_upstream_modules(module) if module in graph.find_upstream_modules(m))
        if cycle:
            cycles.append(sorted([module, *cycle]))
    return cycles


def test_no_import_cycles():
    """docs/architecture.md says there are none; `lint-imports`' layers allow them inside a layer, so look."""
    assert import_cycles("raybench") == []


def test_a_ranks_modules_load_no_pyarrow():
    """A synthetic trial's ranks import the worker and every strategy: none of that loads the store's pyarrow."""
    code = ("import sys, raybench.runtime.worker, raybench.runtime.strategies.fsdp2; "
            "print('pyarrow' in sys.modules, 'ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def _imported_roots(tree: ast.AST) -> set[str]:
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_only_the_drivers_import_ray():
    """Every module of the package is scanned (function-level imports included): Ray belongs to the drivers."""
    importers = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                 if "ray" in _imported_roots(ast.parse(p.read_text()))}
    assert importers, "the scan found no Ray import at all: it is not looking at the package"
    assert sorted(p for p in importers if not p.startswith("drivers/")) == []


MODULE_TABLE_HEADER = "| layer | module | owns |"
BACKTICKED = re.compile(r"`([^`]+)`")


def table_paths(page: str) -> list[str]:
    """The module paths (under raybench/) that the page's module table names, read as a newcomer reads them.

    A layer cell (`runtime/`) names its package and holds for the rows below it until the next one; a layer cell
    without a path is the package root. In a module cell, `x.py` is a module of the layer, and `sub/` is a
    subpackage (its __init__.py) whose modules follow it in the same cell (`strategies/`: `ddp.py`, `tp.py`)."""
    lines = page.splitlines()
    start = lines.index(MODULE_TABLE_HEADER) + 2  # past the header and its --- row
    paths, layer = [], None
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        layer_cell, module_cell = line.split("|")[1:3]
        if layer_cell.strip():
            named = BACKTICKED.findall(layer_cell)
            layer = named[0] if named else ""
            if layer:
                paths.append(f"{layer}__init__.py")
        package = layer
        for name in BACKTICKED.findall(module_cell):
            if name.endswith("/"):
                package = layer + name
                paths.append(f"{package}__init__.py")
            else:
                paths.append(package + name)
    return paths


def test_the_architecture_page_names_every_module_by_its_path():
    """docs/architecture.md is where a newcomer finds a module's job: a module it does not name is a missing row,
    and a path it names that is not a module is a stale one."""
    named = table_paths((PACKAGE.parent / "docs" / "architecture.md").read_text())
    modules = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}
    assert sorted(modules - set(named)) == [], "modules the page's table does not name"
    assert sorted(set(named) - modules) == [], "paths the page's table names that are not modules"
    assert sorted(p for p in set(named) if named.count(p) > 1) == [], "modules named on more than one row"


def test_the_module_table_reads_layers_subpackages_and_the_root():
    page = "\n".join([
        "text `ignored.py`", "", MODULE_TABLE_HEADER, "| --- | --- | --- |",
        "| package | `__init__.py`, `__main__.py` | the root |",
        "| `runtime/` | `worker.py` | one rank, `not_a_path` in prose |",
        "| | `strategies/`: `ddp.py`, `tp.py` | setups |",
        "| | `bench.py` | the loop |",
        "| `spec/` | `stacks/`: `hf.py` | kinds |",
        "", "| layer | other | table |", "| `cli/` | `main.py` | |"])
    assert table_paths(page) == [
        "__init__.py", "__main__.py", "runtime/__init__.py", "runtime/worker.py", "runtime/strategies/__init__.py",
        "runtime/strategies/ddp.py", "runtime/strategies/tp.py", "runtime/bench.py", "spec/__init__.py",
        "spec/stacks/__init__.py", "spec/stacks/hf.py"]


WALK_TABLE_HEADER = "| # | depth | module | function | what the trial becomes there | ↩ |"
MOST_WALK_RETURNS = 5
WALK_COUNT = re.compile(r"\*\*(\d+) returns to a file already visited\*\* in (\d+) lines")


def walk_rows(page: str) -> list[tuple[int, int, str, str, bool]]:
    """The trial walk's rows: (number, depth, module path under raybench/, function, marked as a return)."""
    lines = page.splitlines()
    rows = []
    for line in lines[lines.index(WALK_TABLE_HEADER) + 2:]:
        if not line.startswith("|"):
            break
        number, depth, module, function, _, mark = (c.strip() for c in line.split("|")[1:7])
        rows.append((int(number), int(depth), module.strip("`"), function.strip("`"), mark == "↩"))
    return rows


def returns_to_visited_files(files: list[str]) -> list[bool]:
    """For each line, whether its file appeared on an earlier line but not on the line just before it."""
    return [f in files[:i - 1] and f != files[i - 1] if i else False for i, f in enumerate(files)]


def defines(path: Path, dotted: str) -> bool:
    """Whether the module at `path` defines `dotted`: a function, a class's method, a function's inner function."""
    scope = ast.parse(path.read_text()).body
    for name in dotted.split("."):
        found = [n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name]
        if not found:
            return False
        scope = found[0].body
    return True


def test_returns_to_a_visited_file_are_counted_as_the_page_says():
    files = ["a.py", "a.py", "b.py", "a.py", "c.py", "b.py", "b.py"]
    assert returns_to_visited_files(files) == [False, False, False, True, False, True, False]


def test_the_trial_walk_names_real_functions_and_counts_its_returns():
    """The architecture page's walk of one trial: every line a function of the module it names, numbered in order,
    one level deeper at most per line, its return marks and its count as the lines say."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    rows = walk_rows(page)
    assert [r[0] for r in rows] == list(range(1, len(rows) + 1))
    depths = [r[1] for r in rows]
    assert depths[0] == 0 and all(b <= a + 1 for a, b in zip(depths, depths[1:]))
    assert [f"{m} {f}" for _, _, m, f, _ in rows if not defines(PACKAGE / m, f)] == []
    returns = returns_to_visited_files([r[2] for r in rows])
    assert [r[0] for r, back in zip(rows, returns) if back != r[4]] == [], "lines whose ↩ mark is wrong"
    assert WALK_COUNT.search(page).groups() == (str(sum(returns)), str(len(rows)))
    # At most 5 (13 at commit 760bdd6), the data's preparation walked in full: the payload reaches the ranks
    # without conversions, one module builds the model, and the data is prepared in one room (raybench.data). A
    # change that sends the trial back and forth again shows here.
    assert sum(returns) <= MOST_WALK_RETURNS


def test_the_package_root_holds_only_the_layers():
    """Listing the package shows its layers: every module lives in a layer's subpackage."""
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "__main__.py"]
    layers = {"spec", "data", "results", "planning", "runtime", "drivers", "rehearse", "reports", "cli"}
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"} == layers


MAX_MODULE_LINES = 450
# A module over the limit says why in its docstring, on a line of its own starting with this.
OVER_LIMIT_MARKER = "Over 450 lines:"


def _long_modules_without_a_reason(package: Path) -> list[str]:
    """Modules of `package` over MAX_MODULE_LINES lines whose docstring has no line starting with the marker."""
    offenders = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        lines = len(text.splitlines())
        docstring = ast.get_docstring(ast.parse(text)) or ""
        if lines > MAX_MODULE_LINES and not any(line.strip().startswith(OVER_LIMIT_MARKER)
                                                for line in docstring.splitlines()):
            offenders.append(f"{path.relative_to(package)} ({lines} lines)")
    return offenders


def test_no_module_is_over_450_lines_without_a_reason():
    """A module past 450 lines holds more than one job: split it, or say in its docstring why one module is
    better (a line starting with "Over 450 lines:")."""
    offenders = _long_modules_without_a_reason(PACKAGE)
    assert offenders == []


def test_a_long_module_passes_only_with_its_reason(tmp_path):
    long_body = "x = 1\n" * (MAX_MODULE_LINES + 1)
    (tmp_path / "long.py").write_text('"""A module."""\n' + long_body)
    (tmp_path / "reasoned.py").write_text(f'"""A module.\n\n{OVER_LIMIT_MARKER} one table, kept whole."""\n'
                                          + long_body)
    (tmp_path / "short.py").write_text('"""A module."""\n')
    assert _long_modules_without_a_reason(tmp_path) == [f"long.py ({MAX_MODULE_LINES + 2} lines)"]
