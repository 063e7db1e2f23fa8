"""CLIP on scenes at their own sizes: NaFlex (a patch budget per image) and NaViT packing.

    python -m vitmm.train --config configs/clip_scenes_native.py --workdir workdirs/clip_native
    python -m vitmm.train --config configs/clip_scenes_native.py:loss=sigmoid --workdir ...
    python -m vitmm.train --config configs/clip_scenes_native.py:smoke --workdir /tmp/clip_native_smoke

The demo's towers (``configs/clip_scenes.py``), trained on scenes drawn at random sizes and
aspect ratios (sides 32–128 px, aspect up to 3, made on the fly: ``input.scenes_any``). Each
image is resized by NaFlex to the largest aspect-kept size whose 8-px patch grid fits
``input.packing.max_num_patches`` (64: the demo's 64-px square), and grain's first-fit packer
puts whole images into rows of ``seq_len`` tokens; ``batch_size`` counts rows (32 rows of 256
tokens hold about 128 images, the demo's batch; the logged ``img_per_s`` then counts rows).
Attention stays within each image; the loss pairs each image with its caption and leaves empty
slots out. ``patch_keep`` < 1 adds FLIP's patch dropout. Evaluation runs twice: the demo's
(64-px squares, which the sin-cos tower reads at any grid) and at native sizes (``*_native``:
validation scenes at random sizes, NaFlex to the same budget, packed).

Args: ``steps``, ``difficulty``, ``loss`` (``softmax`` or ``sigmoid``), ``patch_keep``, ``smoke``.
"""

import ml_collections

from configs import clip_scenes, common
from vitmm.config_args import parse_arg


def get_config(arg=None):
    arg = parse_arg(arg, presets=common.SMOKE_ARGS,
                    steps=400, difficulty="easy", loss="softmax", patch_keep=1.0, smoke=False)
    c = clip_scenes.get_config(f"steps={arg.steps},data={arg.difficulty}_64")
    with c.unlocked():
        c.loss = arg.loss
        if arg.loss == "sigmoid":
            c.max_temperature = None
            c.model.temperature_init, c.model.bias_init = 10.0, -10.0
        c.batch_size = 32  # packed rows
        c.input.packing = ml_collections.ConfigDict(dict(max_num_patches=64, seq_len=256, max_images=16, bins=8))
        c.input.scenes_any = ml_collections.ConfigDict(dict(
            difficulty=arg.difficulty, num_examples=20_000, split="train", seed=0, min_side=32, max_side=128,
            max_aspect=3.0))
        c.input.pp = ("naflex({max_num_patches}, {patch_size})|{normalize}|"
                      "tokenize('caption', {max_len}, padding='pad')|keep('image', 'caption_tokens')")
        c.model.image.patch_keep = arg.patch_keep
        val_any = dict(name="scenes_any", split="validation", scenes_any=dict(c.input.scenes_any.to_dict(),
                                                                             num_examples=1000))
        native = dict(max_num_patches=64, seq_len=256, max_images=16)
        c.evals.zeroshot_native = dict(type="zeroshot", data=val_any, native=native, num_examples=1000)
        c.evals.retrieval_native = dict(type="retrieval", data=val_any, native=native, num_examples=1000)
        c.evals.val_native = dict(type="val_loss", data=val_any, native=native, num_examples=1000, batch_size=256)
        if arg.smoke:
            common.smoke(c, steps=arg.steps, batch_size=4)
            c.input.scenes_any.num_examples = 64
            c.input.packing.seq_len = 64
            c.input.packing.max_num_patches = 16
            for name in ("zeroshot_native", "retrieval_native", "val_native"):
                c.evals[name].native.update(max_num_patches=16, seq_len=64)
            c.evals.val_native.batch_size = 32
    c.lock()
    return c
