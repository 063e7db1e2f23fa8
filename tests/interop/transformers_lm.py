"""Run exported LM folders in transformers (in an environment that has it, e.g. ``.venv-eval``):
``python transformers_lm.py FIXTURES FOLDER...`` loads each FOLDER with ``AutoModelForCausalLM`` and
prints, per folder, its class and the largest logit difference from the stored transformers logits
of the fixture of the same name (``FIXTURES/NAME/io.npz``: a ragged, left-padded batch; or the
folder's own ``io.npz`` where it has one), relative
to the largest logit, at the real positions, and the weights transformers found missing (which it
initialises itself) or left unused. ``tests/interop/test_hf_lm.py`` reads the lines."""

import json
import pathlib
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def main(fixtures, *folders):
    for folder in map(pathlib.Path, folders):
        ref = np.load(folder / "io.npz" if (folder / "io.npz").is_file() else pathlib.Path(fixtures) / folder.name
                      / "io.npz")
        model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(ref["input_ids"]), attention_mask=torch.tensor(ref["attention_mask"]),
                           position_ids=torch.tensor(ref["position_ids"])).logits.numpy()
        real = ref["attention_mask"].astype(bool)
        err = float(np.abs(logits - ref["logits"])[real].max() / np.abs(ref["logits"]).max())
        print(json.dumps({"name": folder.name, "class": type(model).__name__, "error": err,
                          "missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"])}))


if __name__ == "__main__":
    main(*sys.argv[1:])
