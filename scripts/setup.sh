#!/usr/bin/env bash
# Create .venv and install refcheck with its test extras.
#
# torch is installed first, pinned to 2.13.0 (the version the goldens were recorded with), from the
# index pip is configured with: which build that is depends on the index, not on this script. On
# PyPI the Linux wheel is the CUDA build (several GB with its nvidia-* wheels); for the CPU build set
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# (the example CI workflow does). transformers is pinned to 5.23.0, the version the goldens were
# recorded with (pyproject.toml bounds it to the tested range 5.17-5.24; `refcheck golden regen`
# shows what another version changes). z-lab's dflash package is installed without its pinned
# extras (it is only used to cross-check our drafter and chain mode).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0"
python -m pip install -q "transformers==5.23.0" -e ".[test,plots]"
python -m pip install -q --no-deps "dflash==0.1.0"
