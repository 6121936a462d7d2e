#!/usr/bin/env bash
# Create the venv that serves whiflash models with Triton Inference Server (nvidia-pytriton's bundled binary).
#
# The Python-backend stub bundled with nvidia-pytriton links Debian's libpython3.11, so the venv must be made with
# /usr/bin/python3.11 (a pyenv-built 3.11 fails inside the stub). torch is installed first, pinned, so that the
# project's `torch>=...` requirement pulls nothing more (a bare `torch` would resolve to a multi-GB CUDA build).
#
# Usage: scripts/setup_triton_env.sh [VENV]   (default: .venv-triton in the repository root)
# Idempotent: an existing venv is reused and only completed.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$root/.venv-triton}"
python=/usr/bin/python3.11

need_apt=()
[ -x "$python" ] || need_apt+=(python3.11)
"$python" -c "import ensurepip, venv" 2>/dev/null || need_apt+=(python3.11-venv)
ldconfig -p | grep -q 'libpython3\.11\.so\.1\.0' || need_apt+=(libpython3.11)
if [ "${#need_apt[@]}" -gt 0 ]; then
    echo "setup_triton_env: installing Debian packages: ${need_apt[*]}" >&2
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need_apt[@]}"
fi

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" -e "$root" "nvidia-pytriton==0.7.0" "tritonclient[http,grpc]" "pytest>=8"
"$venv/bin/python" - <<'PY'
import importlib.util, pathlib, torch
pkg = pathlib.Path(importlib.util.find_spec("pytriton").origin).parent
server = pkg / "tritonserver" / "bin" / "tritonserver"
assert server.is_file(), f"pytriton has no bundled tritonserver at {server}"
print(f"setup_triton_env: torch {torch.__version__}, tritonserver at {server}")
PY
