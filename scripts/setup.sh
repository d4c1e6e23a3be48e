#!/usr/bin/env bash
# Create .venv and install raybench with the pinned dependency set (constraints.txt).
#   scripts/setup.sh          runtime only
#   scripts/setup.sh --test   plus the test extra and the system packages the integration tests use
# torch comes first, pinned, so that pip never pulls a multi-GB CUDA build on a CPU machine. GPU users:
# install the CUDA build of the same torch release into .venv before running this (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
if [ "${1:-}" = "--test" ]; then extras="[test]"; fi
[ -x .venv/bin/python ] || python3 -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
.venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" -c constraints.txt torch
"${pip[@]}" -c constraints.txt -e ".${extras}"
