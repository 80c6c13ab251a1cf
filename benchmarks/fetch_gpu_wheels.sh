#!/usr/bin/env bash
# Fetch the wheels the one-shot GPU check (benchmarks/gpu_check.py) needs beyond a CUDA torch environment into .whl/
# (git-ignored), for CPython 3.12 on manylinux x86_64, without their dependencies: the CUDA environment is expected to
# have the rest (the first GPU run's had torch 2.11, triton 3.6, transformers 5.17, Python 3.12, no TRL/datasets) and
# may have no network. Copy .whl/ there with the checkout and install it offline, from the checkout's root:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 GRPO_MEM_SKIP_EXT=1
# (docs/testing.md, "Running it on your CUDA machine").
#
#   transformers  the package needs >=5.23 (setup.py); that environment had 5.17
#   trl           not in that environment
#   datasets      TRL's GRPOTrainer imports it; not in that environment
#   dill, multiprocess   datasets' dependencies, not in that environment
#   regex         transformers checks regex>=2025.10.22 when imported; its version there is unknown (insurance)
#   peft          TRL imports peft when present; its version there is unknown against transformers 5.25 (insurance)
#
# Usage: benchmarks/fetch_gpu_wheels.sh [DEST]   (DEST defaults to .whl at the repository root; existing wheels kept)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${1:-$root/.whl}"
mkdir -p "$dest"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$dest" \
  transformers==5.25.0 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 regex==2026.11.19 peft==0.21.2
ls -l "$dest"/*.whl
du -cb "$dest"/*.whl | tail -1
