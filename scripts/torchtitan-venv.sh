#!/usr/bin/env bash
# torchtitan's own Python environment for raybench's torchtitan stack (docs/stacks/torchtitan.md): torchtitan 0.3.0
# pins its own stack (datasets<4.8 among it), so it runs out of process, in this environment (stack.python:
# DIR/bin/python).
#
#   scripts/torchtitan-venv.sh DIR            # torch 2.13.0, CPU wheel
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 scripts/torchtitan-venv.sh DIR    # a CUDA wheel
#   TORCH_INDEX_URL= scripts/torchtitan-venv.sh DIR    # torch from pip's own configured index
#
# torch goes in first, from the index asked for; torchtitan's own install then finds its torch requirement met and
# never swaps in another build (a CUDA one on a CPU machine). triton comes with it: torchtitan 0.3.0 imports it
# unconditionally (torchtitan/distributed/minimal_async_ep/kernels.py) and the CPU torch wheels do not bring it
# (a CUDA torch pins its own). raybench itself is not installed there: the trial puts raybench's source on
# PYTHONPATH, and the launcher needs only the standard library, torch and torchtitan.
set -euo pipefail

dir="${1:?usage: scripts/torchtitan-venv.sh DIR}"
python="${PYTHON:-python3}"
torch_index="${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}"

"$python" -m venv "$dir"
if [ -n "$torch_index" ]; then
    "$dir/bin/python" -m pip install "torch==2.13.0" --index-url "$torch_index"
else
    "$dir/bin/python" -m pip install "torch==2.13.0"
fi
# torch pinned again so that no dependency's resolution replaces the build just installed.
"$dir/bin/python" -m pip install "torchtitan==0.3.0" "torch==2.13.0" triton
"$dir/bin/python" -c "import torch, torchtitan.trainer, importlib.metadata as m; print('torch', torch.__version__, \
'- torchtitan', m.version('torchtitan'), '- triton', m.version('triton'))"
echo "stack.python: $dir/bin/python"
