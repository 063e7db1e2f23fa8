"""A converted LM folder's shape without its weights, small enough to carry to a GPU session.

    python -m vitmm.interop --from gguf --src SmolLM2-135M-Instruct.Q4_1.gguf --out workdirs/smollm2
    python -m experiments.gpu.lm_shape --src workdirs/smollm2 --out .gpu_smollm2     # ~2 MB

A device call carries at most 64 MiB; SmolLM2-135M's weights are 98 MB even as Q4_1 GGUF. A
training step's speed does not depend on the weights' values, so the loop-vs-bare-step check of a
VLM stage 1 with SmolLM2-135M (issue 52) runs on this: the same settings, tokenizer and chat
template, and parameters of the same shapes and dtypes that are zero (norm scales one: the run's
numbers stay finite), which the checkpoint's compression stores in a few kilobytes. Its answers
mean nothing; ``source`` in its config says so.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil

import jax
import numpy as np

from vitmm import checkpoint as ckpt_lib
from vitmm.interop import convert


def shape_only(params):
    """Zeros of each parameter's shape and dtype; ones for norm scales."""
    def one(path, x):
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        return np.full(np.shape(x), 1 if "norm" in name else 0, np.asarray(x).dtype)

    return jax.tree_util.tree_map_with_path(one, params)


def main(argv=None) -> pathlib.Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", required=True, help="a `python -m vitmm.interop` LM folder")
    parser.add_argument("--out", required=True, help="the new folder")
    args = parser.parse_args(argv)
    src, out = pathlib.Path(args.src), convert.new_folder(args.out)
    config = ckpt_lib.load_config(src)
    config["source"] = {**config.get("source", {}), "shape_only": f"{src}'s shapes; zero weights, norm scales one"}
    convert.write(out, shape_only(ckpt_lib.load_params(src)), config)
    if (src / "tokenizer.json").is_file():
        shutil.copy(src / "tokenizer.json", out / "tokenizer.json")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote {out} ({size / 2**20:.1f} MiB)")
    return out


if __name__ == "__main__":
    main()
