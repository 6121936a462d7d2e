#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what the tests need, runs them, then runs the Triton tests
# against a real tritonserver from the venv scripts/setup_triton_env.sh makes (its Python stub needs the system
# Python). Exit code: non-zero if anything failed, or if pytest collected no tests (exit 5).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev,onnx,bench,train,serve || exit 1
python -m pytest -q
rc=$?
bash scripts/setup_triton_env.sh || exit 1
.venv-triton/bin/python -m pytest -q tests/test_triton.py
triton_rc=$?
for code in "$rc" "$triton_rc"; do
  if [ "$code" -ne 0 ]; then
    [ "$code" -eq 5 ] && echo "pytest collected no tests" >&2
    exit 1
  fi
done
