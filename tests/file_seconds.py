"""Each test file's measured seconds in the default run, for ordering the run (tests/conftest.py): the heaviest files
start first, so that no long file is left to run alone at the end while the other worker has nothing to do.

`python tests/file_seconds.py REPORT.xml` prints the table from a JUnit report of the default run (pytest
`--junitxml`; each test's time there is its setup, call and teardown), which goes in tests/file_seconds.json. A file
not in the table runs after those that are, in collection order: a stale table orders less well, it never fails.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

TABLE = Path(__file__).with_name("file_seconds.json")


def seconds_by_file(report: str) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for case in ET.parse(report).getroot().iter("testcase"):
        totals[case.get("classname").replace(".", "/") + ".py"] += float(case.get("time") or 0)
    return {path: round(s, 1) for path, s in sorted(totals.items(), key=lambda item: -item[1])}


def load() -> dict[str, float]:
    return json.loads(TABLE.read_text()) if TABLE.exists() else {}


if __name__ == "__main__":
    print(json.dumps(seconds_by_file(sys.argv[1]), indent=0))
