#!/usr/bin/env bash
# Create .venv and install refcheck with its test extras. torch is pinned to the CPU build first
# (an open-ended torch requirement would pull a multi-GB CUDA build); z-lab's dflash package is
# installed without its pinned extras (it is only used to cross-check our drafter and chain mode).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test,plots]"
python -m pip install -q --no-deps "dflash==0.1.0"
