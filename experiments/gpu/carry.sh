#!/usr/bin/env bash
# What a GPU session carries for `experiments/gpu/trainer.sh` (issue 27), made here once:
#   .whl/       the packages `python -m vitmm.train` needs that the GPU image lacks (Python 3.12 wheels,
#               pinned to requirements.txt and to the versions this venv resolved for their dependencies)
#   .gpu_data/  the scenes TFDS build the configs read (~14 MB, made by `make demo`)
# Both are git-ignored (.git/info/exclude); name them in the device call's `carry`.
#   bash experiments/gpu/carry.sh && du -sh .whl .gpu_data     # 64 MiB may travel per call
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude=$(git rev-parse --git-path info/exclude) && mkdir -p "$(dirname "$exclude")" && touch "$exclude"
for d in /.whl/ /.gpu_data/; do grep -qxF "$d" "$exclude" || echo "$d" >> "$exclude"; done
PY=${PY:-.venv/bin/python}
pin() { grep -i "^$1==" requirements.txt | head -1; }
PLATFORMS=()
for n in 35 34 31 28 27 24 17; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
rm -rf .whl && mkdir -p .whl
# The GPU image (../.library/device/KINDS.md) has jax, flax, optax, orbax-checkpoint, etils, absl, numpy,
# pillow, scipy, tensorstore, psutil, pyarrow, requests, tqdm, wrapt, pyyaml, cloudpickle, attrs.
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" --platform manylinux2014_x86_64 -d .whl \
    "$(pin grain)" "$(pin array-record)" "$(pin tensorflow-datasets)" "$(pin ml-collections)" "$(pin tensorboardX)" \
    "$(pin protobuf)" portpicker==1.6.0 dm-tree==0.1.10 immutabledict==4.3.1 simple-parsing==0.1.9 \
    docstring-parser==0.18.0 tensorflow-metadata==1.21.0 googleapis-common-protos==1.76.0 termcolor==3.3.0 \
    toml==0.10.2 2>&1 | grep -v "is ignored: it is neither" || true
"$PY" -m pip wheel -q --no-deps -w .whl promise==2.3 2>&1 | grep -v "is ignored: it is neither" || true
rm -rf .gpu_data && mkdir -p .gpu_data/scenes
cp -r "${TFDS_DATA_DIR:-$HOME/tensorflow_datasets}/scenes/easy_64" .gpu_data/scenes/
ls .whl
du -sh .whl .gpu_data
