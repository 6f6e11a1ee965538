#!/usr/bin/env bash
# Download, into .whl/ (git-ignored), the wheels that `saccade bench gpu` needs on a GPU
# machine whose Python has torch, transformers, peft, tokenizers, safetensors, pillow, numpy,
# rich, httpx, matplotlib and the rest, but no pydantic and no registry to fetch it from
# (the lent H100/H200 machines: Python 3.12, torch 2.11, transformers 5.17; README, "Running
# the GPU checks"). The list is what `saccade bench gpu` imports that such a machine lacks,
# found by scripts/gpu-device-check.sh (`saccade bench gpu --device cpu --quick` in a venv holding
# only that machine's packages, these wheels installed as there): pydantic and what it imports,
# and a typing-extensions new enough for it (pydantic 2.14 needs >= 4.16; the machine's may be
# older). Pure Python except
# pydantic-core (a cp312 manylinux wheel, 2 MB). About 3 MB in all.
#
# And flash-linear-attention (fla), for the linear-attention stage: Qwen3.5's packed rows run on
# its varlen Triton kernels on CUDA when it imports (saccade.models.linear_attention.fla_kernels).
# fla-core holds the kernels (it needs einops, and triton at import: the machine's torch brings
# triton); flash-linear-attention only its layers and models (it asks for transformers, which the
# machine has). All three py3-none-any, about 1.5 MB. Nothing imports fla where it is absent:
# saccade only inside fla_kernels(), transformers' Qwen3.5 module in a try (its torch kernels then).
# Where fla is installed, transformers' Qwen3.5 layers take fla's chunk rule themselves.
#
# There, before saccade:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
set -euo pipefail
cd "$(dirname "$0")/.."
# The versions of uv.lock, so the GPU run imports what the CPU tests ran against.
WHEELS=(
    "pydantic==2.14.3"
    "pydantic-core==2.50.4"
    "annotated-types==0.8.0"
    "typing-inspection==0.4.5"
    "typing-extensions==4.16.0"
    "flash-linear-attention==0.6.0"
    "fla-core==0.6.0"
    "einops==0.8.2"
)
rm -rf .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}"
ls -l .whl
