"""Run exported VLM folders in transformers (in an environment that has it, e.g. ``.venv-eval``):
``python transformers_vlm.py FOLDER INPUTS.npz OUT.npz [FOLDER INPUTS OUT ...]`` loads each with
``AutoModelForImageTextToText`` and ``AutoProcessor``, and for each ``image_i`` / ``question_i`` of
INPUTS (one user turn, rendered by the folder's chat template; ``messages_i``, JSON, instead of
``question_i`` gives the turns as they are; PaliGemma's processor takes the text as it is) writes the
processor's ``input_ids_i`` and ``pixel_values_i``, the ``logits_i`` and a greedy ``answer_i`` of 6
tokens to OUT. ``tests/interop/test_hf_vlm.py`` compares them with vitmm's. A processor whose video
half needs torchvision, which this environment lacks (Qwen2-VL's), is built without it."""

import json
import sys

import numpy as np
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer


def processor_for(folder):
    try:
        return AutoProcessor.from_pretrained(folder)
    except (OSError, ImportError):  # no video processor here: the folder's class, images and text only
        import pathlib

        import transformers
        from transformers import AutoImageProcessor

        settings = json.loads((pathlib.Path(folder) / "processor_config.json").read_text())
        base = getattr(transformers, settings["processor_class"])

        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

        images_only = type(base.__name__, (base,), {"get_attributes": classmethod(get_attributes)})
        tokenizer = AutoTokenizer.from_pretrained(folder)
        extra = {k: v for k, v in settings.items() if k not in ("image_processor", "processor_class")}
        return images_only(image_processor=AutoImageProcessor.from_pretrained(folder), tokenizer=tokenizer,
                           chat_template=tokenizer.chat_template, **extra)


def main(folder, inputs, out):
    model = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="eager").eval()
    processor = processor_for(folder)
    data, results = np.load(inputs), {"class": np.array(type(model).__name__)}
    for i in range(sum(k.startswith("image_") for k in data.files)):
        if f"messages_{i}" in data.files:
            messages = json.loads(str(data[f"messages_{i}"]))
        else:
            messages = [{"role": "user", "content": str(data[f"question_{i}"])}]
        prompt = messages[0]["content"] if "PaliGemma" in type(processor).__name__ else \
            processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        batch = processor(images=Image.fromarray(data[f"image_{i}"]), text=prompt, return_tensors="pt")
        with torch.no_grad():
            logits = model(**batch).logits
            generated = model.generate(**batch, max_new_tokens=6, do_sample=False)
        n = batch["input_ids"].shape[1]
        results.update({f"input_ids_{i}": batch["input_ids"].numpy(), f"logits_{i}": logits.numpy(),
                        f"pixel_values_{i}": batch["pixel_values"].numpy(), f"answer_{i}": generated[0, n:].numpy()})
    np.savez(out, **results)


if __name__ == "__main__":
    for at in range(1, len(sys.argv), 3):  # one process for every folder: torch starts once
        main(*sys.argv[at:at + 3])
