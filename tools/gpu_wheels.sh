#!/usr/bin/env bash
# Wheels for a GPU machine without a network (make gpu-wheels): deepspeed 0.19.8 (pure Python, ops built
# just in time there), this package, and the dependencies such a machine lacks, for CPython 3.12 on x86-64.
# tools/gpu_check.sh installs them with `pip install --no-index --no-deps --target`.
#
# What the machine already has decides the list (the target CUDA image: torch 2.11 + CUDA 13, numpy, transformers
# with its dependencies, einops, msgpack, ninja, psutil, py-cpuinfo, tqdm, packaging, nvidia-ml-py): shipping
# torch or numpy would replace the CUDA build there. Missing there: hjson and pydantic with its own
# dependencies; typing-extensions travels too, because pydantic needs a newer one than torch asks for.
# tools/check_wheels.py then checks every Requires-Dist of the set against the set and that list.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DIR=${WHEEL_DIR:-.whl}
DEEPSPEED_VERSION=${DEEPSPEED_VERSION:-0.19.8}
# pydantic pins pydantic-core exactly; these are the versions the CPU venv runs with deepspeed 0.19.8.
PURE="hjson==3.1.0 pydantic==2.14.4 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0"
BINARY="pydantic-core==2.50.5"
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64"

rm -rf "$DIR" && mkdir -p "$DIR"
# deepspeed's setup.py imports torch to decide which ops to prebuild: none here (DS_BUILD_OPS=0).
DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" "deepspeed==$DEEPSPEED_VERSION"
rm -rf build  # setuptools would reuse a stale build/lib
"$PYTHON" -m pip wheel -q --no-deps -w "$DIR" .
# shellcheck disable=SC2086
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $PLATFORMS -d "$DIR" $PURE $BINARY
"$PYTHON" tools/check_wheels.py "$DIR"
ls -l "$DIR"
