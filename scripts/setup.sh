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
# DeepSpeed's CPU communication backend JIT-builds a shared-memory op (g++, ~30-90 s) the first time it starts;
# DeepSpeed 0.19 has no switch to skip it. Build it once now into the torch extensions cache, so no trial (or test)
# pays for it. Not needed with CUDA, where DeepSpeed communicates through NCCL.
if .venv/bin/python -c "import sys, torch; sys.exit(1 if torch.cuda.is_available() else 0)"; then
  DS_ACCELERATOR=cpu .venv/bin/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" \
    >/dev/null 2>&1 || echo "note: DeepSpeed's CPU shm op did not build (needs g++); deepspeed trials build it" >&2
fi
# The terminal and browser checks (tests/terminal.py: `raybench run` under tmux; the HTML report in chromium, driven
# by playwright) use Debian's packages. Installed here as root when missing; elsewhere those tests say what to install.
if [ -n "$extras" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=()
  command -v tmux >/dev/null || missing+=(tmux)
  command -v chromium >/dev/null || missing+=(chromium)
  if [ ${#missing[@]} -gt 0 ]; then
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; } \
      || echo "note: apt-get could not install ${missing[*]}; the terminal and browser tests will skip" >&2
  fi
fi
