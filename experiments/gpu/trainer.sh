#!/usr/bin/env bash
# Issue 27, part 1: `python -m vitmm.train` itself on a GPU, in one device call of ~5 minutes.
#   bash experiments/gpu/carry.sh                          # here, once: .whl/, .gpu_data/, .gpu_smollm2/
#   run(command="bash experiments/gpu/trainer.sh", carry=[".whl", ".gpu_data", ".gpu_smollm2"], timeout_s=540)
#   TINY_DATA=DIR bash experiments/gpu/trainer.sh --tiny   # here, on the CPU: every step at smoke scale
#   DEMO_S, LOOP_S, RESUME_S: each step's time limit in seconds (default 200, 300, 240)
#   PARTS: the steps to run (default "demo loop loop_siglip loop_vlm loop_threads resume"; the versions always)
# Steps (each one's failure is logged and the next still runs), results in $OUT/gpu_trainer/:
#   versions.txt       python, jax and the packages, the devices
#   demo.json          `make demo`'s config (configs/clip_scenes.py) trained on the GPU: wall time and
#                      its evaluations, against the CPU's 0.602 zero-shot (results/demo/README.md)
#   loop_overhead.json the whole loop's img/s against the bare compiled step, CLIP-B/16 scale
#                      (configs/clip_scenes.py:scale=b16: bf16, cuDNN attention, reader processes
#                      (input.workers=-1), uint8 images normalised on the GPU);
#   loop_siglip.json   the same for SigLIP-B/16 (configs/siglip_scenes.py:scale=b16)
#   loop_vlm.json      a VLM stage 1 (configs/vlm_smollm2_scenes.py:stage=1: the demo tower, pool@16, the LM
#                      frozen) on SmolLM2-135M's shape: .gpu_smollm2 (experiments/gpu/lm_shape.py; zero weights)
#   loop_threads.json  CLIP-B/16 with the earlier input: 16 reader threads in the trainer, float32 images
#   resume_*.json      experiments/reliability/resume_check.py: 60 steps straight, again, and 30 + a resumed 30, step by
#                      step; as XLA runs by default and with --xla_gpu_deterministic_ops=true
set -uo pipefail
cd "$(dirname "$0")/../.."
tiny=0
[ "${1:-}" = "--tiny" ] && tiny=1
R=${OUT:-/tmp/gpu_trainer_out}/gpu_trainer
mkdir -p "$R"
exec > >(tee -a "$R/log.txt") 2>&1
PY=python3
if [ $tiny = 1 ]; then
    PY=.venv/bin/python DATA=${TINY_DATA:?TINY_DATA=a smoke tfds data_dir (the tests build one)}
    DEMO=":smoke" B16=":scale=b16,smoke,attn=xla" RESUME=":smoke" HALF=4 STEPS=30 LOG=5 VLM=",smoke"
    LM_SHAPE=$R/lm_shape  # the tiny GGUF fixture's shape (SmolLM2's is carried to the GPU)
    if [ ! -d "$LM_SHAPE" ]; then
        $PY -m vitmm.interop --from gguf --src tests/fixtures/interop/gguf_llama/tiny.gguf --out "$R/lm" > /dev/null &&
            $PY -m experiments.gpu.lm_shape --src "$R/lm" --out "$LM_SHAPE"
    fi
else
    DATA=$PWD/.gpu_data DEMO="" B16=":scale=b16" RESUME="" HALF=30 STEPS=120 LOG=10 VLM="" LM_SHAPE=$PWD/.gpu_smollm2
    source experiments/gpu/site.sh
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
PARTS=${PARTS:-demo loop loop_siglip loop_vlm loop_threads resume}
step() { echo "=== $1 ($(date -u +%H:%M:%S))"; }
wanted() { [[ " $PARTS " == *" $1 "* ]] || { echo "=== $1: not in PARTS"; false; }; }
# limited SECONDS CMD...: CMD for at most SECONDS, or until DEADLINE (epoch seconds, set by session.sh) if that
# comes first; skipped under 30 s. SIGKILL 15 s after the SIGTERM (a run that saves on SIGTERM may be compiling).
limited() {
    local s=$1; shift
    if [ -n "${DEADLINE:-}" ] && [ $(( DEADLINE - $(date +%s) )) -lt "$s" ]; then s=$(( DEADLINE - $(date +%s) )); fi
    if [ "$s" -lt 30 ]; then echo "skipped: $s s left before the deadline"; return 1; fi
    timeout -k 15 "$s" "$@"
}

step versions
$PY - > "$R/versions.txt" <<'EOF' || echo "FAILED: versions"
import importlib.metadata as md, sys, jax
print("python", sys.version.split()[0])
for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "tensorflow-datasets", "array-record",
             "ml-collections", "numpy", "protobuf"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "missing")
print("devices", jax.devices())
EOF
cat "$R/versions.txt"

if wanted demo; then
step "demo config"
t0=$(date +%s.%N)
limited ${DEMO_S:-200} $PY -m vitmm.train --config "configs/clip_scenes.py$DEMO" --workdir "$R/demo" \
    --config.input.data_dir="$DATA" || echo "FAILED: demo config"
t1=$(date +%s.%N)
$PY - "$R" "$t0" "$t1" <<'EOF' || echo "FAILED: demo.json"
import json, pathlib, sys
r = pathlib.Path(sys.argv[1])
rows = [json.loads(x) for x in (r / "demo/metrics.jsonl").read_text().splitlines() if x.strip()]
evals = {k: v for row in rows for k, v in row.items() if "/" in k}
speeds = sorted(row["img_per_s"] for row in rows if "img_per_s" in row)
out = dict(wall_s=float(sys.argv[3]) - float(sys.argv[2]), steps=max(row["step"] for row in rows),
           median_img_per_s=speeds[len(speeds) // 2] if speeds else None, last_evals=evals,
           cpu_reference={"zeroshot/accuracy": 0.602, "source": "results/demo/README.md"})
(r / "demo.json").write_text(json.dumps(out, indent=1))
print(json.dumps(out, indent=1))
EOF
fi

if wanted loop; then
step "loop against the bare step: CLIP-B/16"
limited ${LOOP_S:-300} $PY -m experiments.gpu.loop_overhead --config "configs/clip_scenes.py$B16" --steps $STEPS --log_every $LOG \
    --set input.data_dir="$DATA" --out "$R/loop_overhead.json" || echo "FAILED: loop_overhead"
fi
if wanted loop_siglip; then
step "loop against the bare step: SigLIP-B/16"
limited ${LOOP_S:-300} $PY -m experiments.gpu.loop_overhead --config "configs/siglip_scenes.py$B16" --steps $STEPS \
    --log_every $LOG --set input.data_dir="$DATA" --out "$R/loop_siglip.json" || echo "FAILED: loop_siglip"
fi
if wanted loop_vlm; then
step "loop against the bare step: VLM stage 1 on SmolLM2-135M's shape"
limited ${LOOP_S:-300} $PY -m experiments.gpu.loop_overhead --config "configs/vlm_smollm2_scenes.py:stage=1$VLM" \
    --steps $((STEPS * 5)) --log_every $((LOG * 5)) --set input.data_dir="$DATA" --set init.lm="$LM_SHAPE" \
    --set init.vision=results/native/cosine/tower --out "$R/loop_vlm.json" || echo "FAILED: loop_vlm"
fi
if wanted loop_threads; then
step "loop against the bare step: CLIP-B/16 read by threads in the trainer, float32 images"
limited ${LOOP_S:-300} $PY -m experiments.gpu.loop_overhead --config "configs/clip_scenes.py$B16" --steps $STEPS --log_every $LOG \
    --set input.data_dir="$DATA" --set input.workers=0 --set input.num_threads=16 --set input.device_normalize=False \
    --out "$R/loop_threads.json" || echo "FAILED: loop_threads"
fi

if wanted resume; then
step "resume"  # as the GPU runs by default (not repeatable run to run), then with deterministic kernels
limited ${RESUME_S:-240} $PY -m experiments.reliability.resume_check --config "configs/clip_scenes.py$RESUME" --half $HALF --repeat \
    --set input.data_dir="$DATA" --out "$R/resume_default.json" || echo "FAILED: resume (default)"
limited ${RESUME_S:-240} $PY -m experiments.reliability.resume_check --config "configs/clip_scenes.py$RESUME" \
    --half $HALF --repeat --set input.data_dir="$DATA" --set deterministic=True \
    --out "$R/resume_deterministic.json" || echo "FAILED: resume (deterministic)"
fi
rm -rf "$R/demo/checkpoints"
step done
