#!/usr/bin/env bash
# Fetch the wheels a GPU machine without a package index needs to run kimik3's benchmarks and CUDA
# tests beside the torch, triton, numpy, tokenizers and transformers it already has, plus the fla
# peer (fla-core, flash-linear-attention 0.6.0, the versions of shared/anchors).
#
#   bash benchmarks/offline_wheels.sh .whl [PYTHON_VERSION]      # here, where PyPI is reachable
#   # there: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   #        export PYTHONPATH=$PWD/src:/tmp/site
#
# All are pure-Python wheels (py3-none-any), so one download serves any Linux x86-64 or Arm machine;
# PYTHON_VERSION (default 3.12, the H200 machines' Python) only steers pip's resolver. antlr4's
# runtime (Hydra's grammar) is published as a source archive only, so it is built into a wheel here.
# ~2 MB in all.
set -euo pipefail

out="${1:?usage: offline_wheels.sh OUT_DIR [PYTHON_VERSION]}"
py="${2:-3.12}"
mkdir -p "$out"

pure=(
    "hydra-core==1.3.2" "omegaconf==2.3.0" "tqdm>=4.66"          # kimik3's runtime dependencies
    "pytest>=8" "pluggy>=1.5" "iniconfig>=2"                      # the CUDA tests
    "fla-core==0.6.0" "flash-linear-attention==0.6.0" "einops"    # the fla peer (--peer fla, kda_kernels.py)
)
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$py" --implementation py \
    --platform any -d "$out" "${pure[@]}"
python3 -m pip wheel --quiet --no-deps -w "$out" "antlr4-python3-runtime==4.9.3"
ls -1 "$out"
