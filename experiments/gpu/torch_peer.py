"""The PyTorch peer of ``experiments/gpu/bench.py``'s ViT cases: timm's ViT trained the way a
PyTorch user trains it fast, timed the way ``bench.py`` times vitmm, in the same device call.

Each case: ``timm`` ViT-B/16 (batch 256) or ViT-L/16 (batch 128) at 224 px with global average
pooling and no class token (196 tokens, as ``bench.py``'s "cudnn gap(196)" cases), bf16 autocast,
float32 parameters, fused AdamW, PyTorch's SDPA attention (timm's default), the model compiled
with ``torch.compile`` (as timm's ``train.py --torchcompile``) and also run eagerly. Two warm-up
steps (compilation), then ``--repeats`` timings of ``--steps`` back-to-back steps, synchronising
only at the end of each; the median step.
MFU uses ``bench.py``'s FLOP count (``vitmm.models.vit_tools.forward_flops``, 3 × forward) and
peak, so the two scripts' rows compare directly. One JSON row per case and mode, appended to
``--out`` as it finishes (a call cut off keeps what it measured).

    python -m experiments.gpu.torch_peer --out results/gpu_trainer/torch_peer.jsonl
    python -m experiments.gpu.torch_peer --tiny   # a one-block Ti/16 at 32 px on any device

Needs ``torch`` and ``timm`` (the GPU image has both; vitmm does not depend on them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import time

from experiments.gpu.bench import PEAK, TINY
from vitmm.models import vit_tools
from vitmm.models.vit import decode_variant

CASES = {"ViT-B/16": ("vit_base_patch16_224", "B/16", 256), "ViT-L/16": ("vit_large_patch16_224", "L/16", 128)}


def build(name: str, tiny: bool, device):
    """``(model, optimizer, images, labels, training FLOPs per step)`` for one case."""
    import timm
    import torch

    timm_name, variant, batch = CASES[name]
    res, kw = 224, {}
    if tiny:
        timm_name, variant, batch, res = "vit_tiny_patch16_224", "Ti/16", TINY["batch"], TINY["res"]
        kw = dict(img_size=res, depth=TINY["depth"])
    model = timm.create_model(timm_name, num_classes=1000, global_pool="avg", class_token=False, **kw).to(device)
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    generator = torch.Generator(device="cpu").manual_seed(0)
    images = torch.randn(batch, 3, res, res, generator=generator).to(device)
    labels = torch.randint(0, 1000, (batch,), generator=generator).to(device)
    arch = decode_variant(variant)
    if tiny:
        arch = dataclasses.replace(arch, depth=TINY["depth"])
    flops = 3 * vit_tools.forward_flops(arch, (res, res), num_prefix_tokens=0) * batch
    return model, optimizer, images, labels, flops


def train_step(model, optimizer, device):
    import torch

    def step(images, labels):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def time_case(name: str, compiled: bool, args, device) -> dict:
    import torch

    model, optimizer, images, labels, flops = build(name, args.tiny, device)
    step = train_step(torch.compile(model) if compiled else model, optimizer, device)  # the model, as timm's
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    for _ in range(2):  # compilation, then a step on the compiled program
        loss = step(images, labels)
    sync()
    warmup_s = time.perf_counter() - start
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(args.steps):
            loss = step(images, labels)
        sync()
        times.append((time.perf_counter() - start) / args.steps)
    step_s = statistics.median(times)
    return dict(case=name, mode="torch.compile" if compiled else "eager", batch=images.shape[0],
                step_ms=step_s * 1e3, step_ms_range=[min(times) * 1e3, max(times) * 1e3],
                examples_per_s=images.shape[0] / step_s, mfu=flops / step_s / PEAK["bf16"],
                warmup_s=warmup_s, loss=float(loss), device=str(torch.cuda.get_device_name() if device.type == "cuda"
                                                                 else device),
                torch=torch.__version__, tiny=args.tiny)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="ViT-B/16,ViT-L/16", help=f"comma-separated, of {sorted(CASES)}")
    parser.add_argument("--modes", default="compile,eager", help="compile and/or eager")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="one-block Ti/16 at 32 px, batch 2, on any device")
    parser.add_argument("--out", default="", help="a JSON-lines file the rows are appended to")
    args = parser.parse_args(argv)
    import torch

    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown or not set(modes) <= {"compile", "eager"}:
        raise SystemExit(f"torch_peer: unknown case {unknown} or mode {modes}; cases: {sorted(CASES)}; "
                         "modes: compile, eager")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    rows = []
    for name in cases:
        for mode in modes:
            try:
                row = time_case(name, mode == "compile", args, device)
            except Exception as err:  # a failed case keeps the others' rows
                row = dict(case=name, mode=mode, error=f"{type(err).__name__}: {err}"[:500])
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with pathlib.Path(args.out).open("a") as f:
                    f.write(json.dumps(row) + "\n")
    return rows


if __name__ == "__main__":
    sys.exit(0 if all("error" not in r for r in main()) else 1)
