#!/usr/bin/env bash
# torchtune's own Python environment for raybench's torchtune stack (docs/stacks/torchtune.md): torchtune 0.6.1 pins
# its own stack, so it runs out of process, in this environment (stack.python: DIR/bin/python).
#
#   scripts/torchtune-venv.sh DIR            # torch 2.13.0, CPU wheel
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 scripts/torchtune-venv.sh DIR    # a CUDA wheel
#   TORCH_INDEX_URL= scripts/torchtune-venv.sh DIR    # torch from pip's own configured index
#
# torchao stays at 0.11.0: newer torchao releases break `import torchtune` 0.6.1. raybench itself is not installed
# there: the trial puts raybench's source on PYTHONPATH, and the launcher needs only the standard library and torch.
set -euo pipefail

dir="${1:?usage: scripts/torchtune-venv.sh DIR}"
python="${PYTHON:-python3}"
torch_index="${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}"

"$python" -m venv "$dir"
if [ -n "$torch_index" ]; then
    "$dir/bin/python" -m pip install "torch==2.13.0" --index-url "$torch_index"
else
    "$dir/bin/python" -m pip install "torch==2.13.0"
fi
"$dir/bin/python" -m pip install "torchtune==0.6.1" "torchao==0.11.0"
"$dir/bin/python" -c "import torch, torchtune; print('torch', torch.__version__, '- torchtune', torchtune.__version__)"
echo "stack.python: $dir/bin/python"
