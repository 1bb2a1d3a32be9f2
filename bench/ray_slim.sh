#!/usr/bin/env bash
# Builds a Ray for the GPU machine that fits its 64 MiB transfer limit: Ray's cp312 wheel (79 MB)
# without the libraries this project never imports (RLlib, Tune, Train, Serve, Data, LLM, the
# Java jars, the dashboard's web client), as an xz tarball (~28 MB), plus the small wheels Ray
# needs that the GPU image lacks (jsonschema and its helpers) and submitit.
#   bash bench/ray_slim.sh [DIR]      (default .ray; run_gpu.sh installs DIR/* when Ray is missing)
set -euo pipefail
dir=${1:-.ray}
version=$(python3 -c "import ray; print(ray.__version__)" 2>/dev/null || echo 2.60.0)
mkdir -p "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pip_dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 "$@"; }
pip_dl -d "$tmp" "ray==$version"
pip_dl -d "$dir" jsonschema jsonschema-specifications referencing rpds-py submitit
(cd "$tmp" && unzip -q ray-*.whl && rm ray-*.whl \
  && rm -rf ray/jars ray/rllib ray/tune ray/train ray/serve ray/data ray/llm ray/dashboard/client/build \
  && find ray -name '*.map' -delete \
  && tar -cf - ray ray-*.dist-info | xz -T0 -6 >"$OLDPWD/$dir/ray_slim.tar.xz")
ls -la "$dir"
