"""What fits: per-GPU memory of the GPU configs from ``--dry_run`` (``vitmm.train.dry_run``), for the
memory table in ``results/memory/``.

    python -m experiments.bench.memory --target h100   # compiled for H100s on any machine (JAX's CUDA plugin)
    python -m experiments.bench.memory                 # compiled for this machine's devices (one GPU visible)
    python -m experiments.bench.memory --tiny --out /tmp/memory   # the same rows shrunk (a CPU check)

Rows: CLIP ViT-B/16 (batch 256) and ViT-L/16 (128) at 224 px, SigLIP So400m/14 at 224 px (128, the
sigmoid loss), and LLaVA-1.5-shaped VLMs (CLIP ViT-L/14 at 336 px: 576 visual tokens, the MLP
connector) on Qwen2-0.5B, 1.5B and 7B-sized LMs (their published widths, depths, heads, MLP widths
and vocabularies; bfloat16 matmuls), trained as LLaVA-1.5 trains: the tower frozen, the LM's blocks
checkpointed (``remat_policy="nothing_saveable"``, LLaVA's ``--gradient_checkpointing``), fused
attention on a GPU (``attn_impl="cudnn"``), and the logits made 4,096 tokens at a time
(``model.loss_chunk``); stage 1 (connector only, batch 32 a GPU, captions in 128 text positions after
the 576 visual ones), stage 2 (connector and LM, batch 16, conversations to 2,048 positions) and
stage 2 with LoRA rank 8. Three more rows take those settings away from the 0.5B stage 2 one by one.

Each row compiles the training step twice and records ``plan``'s numbers per device
(``results/memory/rows.jsonl``, one row at a time: a rerun skips the rows it has, and refuses
rows made with other ``--tiny`` or ``--target`` settings): for one GPU
(data parallel) and for eight with FSDP (``fsdp=True``, the same batch a GPU: eight times the
global batch), each the program XLA compiles for those devices. With ``--target`` the devices are
compile-only GPUs of that card (``vitmm.train.gpu_targets``): the program and buffer assignment a
GPU's XLA makes, with default kernel tilings (no autotuning without the card). Without it the
devices are this machine's: on a CPU the numbers are XLA:CPU's (float32 matmuls, no fused
attention), several times a GPU's temporaries; the table says which backend made it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

from vitmm.config_args import load
from vitmm.data import examples
from vitmm.data import tokenizer as tok_lib
from vitmm.study import outputs
from vitmm.train import dry_run

ROOT = pathlib.Path(__file__).resolve().parents[2]
GIB = 2**30

# Published sizes (the models' config.json): width, depth, heads, kv heads, MLP width, vocabulary, tied head.
QWEN2 = {"0.5B": (896, 24, 14, 2, 4864, 151936, True), "1.5B": (1536, 28, 12, 2, 8960, 151936, True),
         "7B": (3584, 28, 28, 4, 18944, 152064, False)}
STAGES = {"stage 1": ("llava_pretrain", "", 32), "stage 2": ("llava_finetune", "", 16),
          "stage 2, LoRA 8": ("llava_finetune", "lora=8,", 16)}


def rows(tiny: bool, target: str | None = None) -> list[tuple[str, str, str, dict]]:
    """``(name, config file, its args, overrides)`` of each row (``tiny``: every model shrunk)."""
    import jax

    out = []
    attn = "cudnn" if target or jax.default_backend() == "gpu" else "xla"  # cuDNN's fused attention on a GPU
    clip = "clip_scenes.py", f"scale=b16,attn={attn}" + (",smoke" if tiny else "")
    for name, variant, batch, extra in [("CLIP ViT-B/16, 224 px", "B/16", 256, {}),
                                        ("CLIP ViT-L/16, 224 px", "L/16", 128, {}),
                                        ("SigLIP So400m/14, 224 px", "So400m/14", 128, {"loss": "sigmoid"})]:
        over = {"batch_size": 8 if tiny else batch, "model.image.variant": "S/16" if tiny else variant, **extra}
        out.append((name, *clip, over))
    for lm_name, (width, depth, heads, kv, mlp, vocab, tied) in QWEN2.items():
        lm = dict(width=width, depth=depth, num_heads=heads, num_kv_heads=kv, mlp_dim=mlp, vocab_size=vocab,
                  tie_embeddings=tied, qkv_bias=True, rope_theta=1e6, dtype_mm="bfloat16")
        if tiny:
            lm.update(width=64, depth=2, num_heads=4, num_kv_heads=2, mlp_dim=128, vocab_size=300)
        tower = dict(variant="S/16" if tiny else "L/14", pool="tok", class_token=True, dtype_mm="bfloat16")
        fused = {"attn_impl": "cudnn"} if attn == "cudnn" else {}
        remat = {"remat_policy": "nothing_saveable"}  # LLaVA's --gradient_checkpointing
        for stage, (config, arg, batch) in STAGES.items():
            text = 64 if tiny else (128 if stage == "stage 1" else 2048 - 576)  # captions; conversations to 2,048
            over = {"batch_size": 4 if tiny else batch, "model.lm": {**lm, **fused, **remat},
                    "model.vision": {**tower, **fused}, "input.image_size": 64 if tiny else 336, "model.max_len": text,
                    "model.loss_chunk": 64 if tiny else 4096, "init.allow_random_tower": True}
            name = f"VLM: CLIP ViT-L/14-336 + Qwen2-{lm_name}-sized LM, {stage}"
            args = f"{arg}connector=mlp,budget=all,steps=10"
            out.append((name, f"{config}.py", args, over))
            if lm_name == "0.5B" and stage == "stage 2":  # what each setting saves, taken away one by one
                over = {**over, "model.loss_chunk": None}
                out.append((name + ", all logits at once", f"{config}.py", args, over))
                over = {**over, "model.lm": {**lm, **fused}}
                out.append((name + ", all logits at once, no checkpointing", f"{config}.py", args, over))
                if fused:
                    out.append((name + ", all logits at once, no checkpointing, XLA's attention", f"{config}.py",
                                args, {**over, "model.lm": lm, "model.vision": tower}))
    return out


class WideBytes(tok_lib.ByteTokenizer):
    """Bytes in a vocabulary of ``vocab_size`` ids: a VLM row's LM keeps its own vocabulary (its
    embedding and head) without its tokenizer, which is not here."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size


def measure(name: str, config_file: str, arg: str, overrides: dict, data: pathlib.Path, target: str | None,
            devices: int, fsdp: bool) -> dict:
    extra = {"input.data_path": str(data)} if config_file.startswith("llava") else {}
    overrides = {**overrides, "batch_size": overrides["batch_size"] * devices, "fsdp": fsdp}
    config = load(ROOT / "configs" / config_file, arg, **extra, **overrides)
    start = time.perf_counter()
    tokenizer = WideBytes(config.model.lm.vocab_size) if "model.lm" in overrides else None
    needs = dry_run.plan(config, tokenizer, target=target, num_devices=devices) if target else \
        dry_run.plan(config, tokenizer)
    return {**needs, "batch_per_gpu": config.batch_size // devices, "compile_s": round(time.perf_counter() - start, 1)}


def measure_row(name: str, config_file: str, arg: str, overrides: dict, data: pathlib.Path,
                target: str | None) -> dict:
    """One GPU (data parallel), and eight with FSDP where there is a target to compile eight for."""
    one = measure(name, config_file, arg, overrides, data, target, 1, False)
    row = {"row": name, "config": f"configs/{config_file}:{arg}", **one}
    if target:
        eight = measure(name, config_file, arg, overrides, data, target, 8, True)
        row["fsdp8"] = {k: eight[k] for k in ("parameters", "optimizer_state", "temporaries", "peak", "compile_s")}
    return row


def table(results: list[dict]) -> str:
    """The memory table: one and eight GPUs, GiB a GPU."""
    gib = lambda b: f"{b / GIB:.2f}"  # noqa: E731
    lines = ["| run | batch a GPU | parameters | optimizer state | temporaries | 1 GPU: peak | 8 GPUs (FSDP): peak | "
             "TFLOPs a step a GPU |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        # Without eight devices to compile for: parameters and optimizer state divided by 8, the rest as on one.
        eight = r["fsdp8"]["peak"] if "fsdp8" in r else r["peak"] - (r["parameters"] + r["optimizer_state"]) * 7 / 8
        lines.append(f"| {r['row']} | {r['batch_per_gpu']} | {gib(r['parameters'])} | {gib(r['optimizer_state'])} | "
                     f"{gib(r['temporaries'])} | {gib(r['peak'])} | {gib(eight)} | {r['flops'] / 1e12:.2f} |")
    backend = sorted({r["backend"] for r in results})
    compiled = all("fsdp8" in r for r in results)
    lines += ["", f"GiB a device, from `--dry_run` compiled for {', '.join(backend)} (`vitmm.train.dry_run`); "
              + ("8 GPUs: the step compiled for eight with FSDP at the same batch a GPU."
                 if compiled else "8 GPUs: parameters and optimizer state divided by 8 (an estimate; gradients are "
                 "temporaries), temporaries as on one GPU at the same batch a GPU.")]
    return "\n".join(lines)


def check_settings(done: dict, path: pathlib.Path, tiny: bool, target: str | None) -> None:
    """Refuses a rerun into a folder whose rows were made for other settings (row names do not say
    whether the models were shrunk or which devices compiled them, so a rerun would reuse them)."""
    import jax

    wanted = (tiny, target or jax.default_backend())
    for r in done.values():
        had = (r.get("tiny", False), r["backend"])
        if had != wanted:
            raise SystemExit(f"{path} holds rows made with tiny={had[0]} for {had[1]} (e.g. {r['row']!r}); this run "
                             f"asks for tiny={wanted[0]} for {wanted[1]}: write to another --out, or remove the file "
                             "to measure again.")


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "results/memory"))
    parser.add_argument("--tiny", action="store_true", help="every model shrunk: a check of the script on a CPU")
    parser.add_argument("--only", default="", help="rows whose name contains this")
    parser.add_argument("--target", default=None, help="compile for GPUs of this card (vitmm.train.gpu_targets), "
                        "not this machine's devices")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    done_path = out / "rows.jsonl"
    done = {json.loads(line)["row"]: json.loads(line) for line in done_path.open()} if done_path.exists() else {}
    check_settings(done, done_path, args.tiny, args.target)
    data = examples.write_llava(pathlib.Path(tempfile.mkdtemp(prefix="vitmm_memory_")), 256, resolution=64)  # 8 × 32
    results = []
    for name, config_file, arg, overrides in rows(args.tiny, args.target):
        if args.only not in name:
            continue
        if name not in done:
            done[name] = {**measure_row(name, config_file, arg, overrides, data, args.target), "tiny": args.tiny}
            with done_path.open("a") as f:
                f.write(json.dumps(done[name]) + "\n")
            print(f"{name}: {dry_run.report(done[name]).splitlines()[0]}", flush=True)
        results.append(done[name])
    outputs.write_outputs(out, "memory", {"tiny": args.tiny, "rows": len(results), "target": args.target},
                          table(results),
                          {"memory.csv": results})
    return results


if __name__ == "__main__":
    main()
