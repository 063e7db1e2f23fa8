"""LLaVA stage 1 on your own data: a pretrained tower and LM, the connector trained on image–caption
conversations (LLaVA's ``blip_laion_cc_sbu_558k.json`` layout), tower and LM frozen.

    make demo                                                        # a tower: workdirs/clip_scenes
    python -m vitmm.data examples --format llava --out /tmp/llava_demo --num 2000   # or your LLaVA folder
    python -m vitmm.train --config configs/llava_pretrain.py --workdir workdirs/llava_s1 \\
        --config.input.data_path=/tmp/llava_demo/data.json --config.input.image_folder=/tmp/llava_demo \\
        --config.init.vision=workdirs/clip_scenes --config.init.lm=workdirs/smollm2
    python -m vitmm.train --config configs/llava_pretrain.py:smoke --workdir /tmp/llava_s1_smoke \\
        --config.input.data_path=/tmp/llava_demo/data.json

Each example is rendered with the LM's chat template (``init.lm``'s; without one, plain
``[BOS] question answer [EOS]`` turns), the loss on every assistant turn, the visual tokens where
``<image>`` stands; text-only examples train the LM part alone. Images are padded to a square with
the tower's mean colour and resized, as LLaVA-1.5's stage 2 does (``--image_aspect_ratio pad``). Its
stage 1 (``scripts/v1_5/pretrain.sh``) differs in both: the shorter side resized and centre-cropped,
and the ``plain`` template (``<image>`` then the caption, no chat turns). A conversation longer
than ``model.max_len`` text tokens loses whole exchanges from its end (``conversation_tokens``'
``overflow``), and an example that cannot be used is skipped and counted (``input.max_skipped_share``).

Args: ``connector`` (a name in ``vitmm.models.connectors.REGISTRY``; LLaVA-1.5's is ``mlp``),
``budget`` (visual tokens, or ``all``), ``steps``, ``batch``, ``smoke``, ``pack`` (a row length in
positions: conversations packed into rows, ``batch`` rows a step; 0: one conversation a row, padded
to ``model.max_len``), ``images`` (images an example may have; more than 1 needs ``pack``), ``frames``
(a video's frames, ``data.video``'s sampling; needs ``pack``), ``temporal`` (frames a temporal
patch merges, Qwen2-VL's 2; a still image is repeated, a pretrained tower's patch kernel inflated),
``native`` (a patch budget: each image at its own size, NaFlex, one visual token a patch, or a 2×2
window with ``patch_merger``/``pixel_shuffle`` (Qwen2-VL's); the tower's patches packed NaViT-style;
needs ``pack``), ``anyres`` (a tile side: LLaVA-NeXT's AnyRes on each image at its own size, its
views in the image slots; needs ``pack``).
``input.mixture`` takes several sources (LLaVA-NeXT's list with ``sampling`` rules, or ``weight`` per
source).
"""

import ml_collections
from ml_collections import config_dict

from configs import common
from vitmm.config_args import parse_arg

TOWER = dict(width=128, depth=4, mlp_dim=512, num_heads=4, patch_size=8, pool="gap", class_token=False,
             posemb="sincos2d")  # a run without init.vision (smoke tests): configs/clip_scenes.py's tower
KEEP = "keep('image', 'ids', 'answer_mask', 'prompt_len', 'image_pos', 'has_image', " \
       "optional=('more_images', 'image_positions'))"


def get_config(arg=None):
    arg = parse_arg(arg, presets=common.SMOKE_LLAVA_ARGS, connector="mlp", budget="all", steps=1000, batch=32,
                    smoke=False, pack=0, images=1, frames=0, temporal=1, native=0, anyres=0)
    if arg.frames < 0 or arg.temporal < 1:
        raise ValueError(f"frames={arg.frames}, temporal={arg.temporal}: frames is a video's frames (0: no video) and "
                         "temporal the frames a temporal patch merges (1: none, Qwen2-VL's 2).")
    if arg.frames and arg.anyres:  # each frame would be a base view and tiles: more than the slots, every video skipped
        raise ValueError(f"frames={arg.frames} with anyres={arg.anyres}: a video's frames as AnyRes views are not "
                         "supported yet (LLaVA-OneVision shows a video's frames as base views only); leave anyres out.")
    if (arg.images > 1 or arg.frames or arg.native or arg.anyres) and not arg.pack:
        raise ValueError(f"images={arg.images}, frames={arg.frames}, native={arg.native}, anyres={arg.anyres}: several "
                         "images, a video or images at their own sizes train as flat sequences; set pack=LENGTH too "
                         "(e.g. pack=1024).")
    c = ml_collections.ConfigDict()
    c.task = "vlm"
    c.seed = 0
    c.deterministic = False  # True: a GPU run repeats bit for bit (vitmm/train/determinism.py)
    c.total_steps = arg.steps
    c.batch_size = arg.batch  # conversations per step (LLaVA-1.5: 256 in stage 1, 128 in stage 2)
    c.parallel = "jit"
    c.fsdp = False
    c.tensor_parallel = 1  # devices a layer's projections are split over (a `model` mesh axis)
    c.tokenizer = config_dict.placeholder(str)  # default: init.lm's, else bytes
    c.log_every = 10
    c.eval_every = c.checkpoint_every = max(arg.steps // 4, 1)
    c.keep_checkpoints = 2
    c.allow_config_change = False
    c.sync_every = 8

    decode = f"decode(max_images={arg.images}, num_frames={arg.frames or 8})" if arg.pack else "decode"
    temporal = f"temporal_patch({arg.temporal})|" if arg.temporal > 1 else ""
    merge = 2 if arg.connector in ("patch_merger", "pixel_shuffle") else 1  # own sizes: Qwen2-VL's 2×2 windows
    size = f"naflex({{max_num_patches}}, {{patch_size}}, merge={merge})|" if arg.native else \
        "" if arg.anyres else "pad_to_square({image_mean})|resize({image_size})|"  # AnyRes: views in data.sequences
    pp = (f"{decode}|{size}normalize({{image_mean}}, {{image_std}})|{temporal}"
          "conversation_tokens({max_len}, overflow='truncate_turns', max_answer={loss_positions})|" + KEEP)
    c.input = ml_collections.ConfigDict(common.raw_input(image_size=64, pp=pp, num_threads=2, prefetch=64,
                                                         device_prefetch=2))
    # Flat sequences (data.sequences): length > 0 packs conversations into rows of that many positions
    # (text + visual tokens; batch_size then counts rows) and max_images image slots (the tower encodes
    # batch_size · max_images images a step, empty slots too); pack=False puts one a row (padded);
    # bins: rows open at once in the first-fit packer (more: less padding); tower_length > 0: images at
    # their own sizes (naflex to max_num_patches), each row's tower patches packed into that many tokens.
    views = 5 if arg.anyres else 1  # AnyRes: a base view and up to 2×2 tiles an image
    slots = max(arg.images * views, -(-arg.frames // arg.temporal))  # a video's frames are images
    c.input.sequences = dict(length=arg.pack, max_images=2 * slots if arg.pack else slots, pack=True, bins=8,
                             max_num_patches=arg.native, tower_length=2 * slots * arg.native)
    c.input.image_mean = config_dict.placeholder(tuple)  # default: what init.vision records, else 0.5
    c.input.image_std = config_dict.placeholder(tuple)

    c.model = ml_collections.ConfigDict()
    c.model.vision = dict(TOWER, **common.kernels())
    c.model.connector = dict(name=arg.connector, budget=arg.budget if arg.budget == "all" else int(arg.budget))
    if arg.native and merge > 1:  # images at their own sizes: each 2×2 window one token
        c.model.connector = dict(name=arg.connector, merge=merge)
    c.model.lm = dict(vocab_size=259, width=128, depth=4, num_heads=4,  # without init.lm: bytes, from scratch
                      **common.kernels(remat_policy=config_dict.placeholder(str)))
    c.model.vision_layer = -2  # LLaVA's: the second-to-last block, HF's hidden_states[-2]
    c.model.use_cls = False
    c.model.prefix_lm = False
    c.model.mrope = False
    tile = arg.anyres  # LLaVA-NeXT's AnyRes: a base view + tiles of the best of 1×2, 2×1, 2×2 tiles
    c.model.anyres = dict(tile=tile, pinpoints=((tile, 2 * tile), (2 * tile, tile), (2 * tile, 2 * tile))) if tile \
        else None
    c.model.max_len = 384  # text tokens of a conversation (LLaVA-1.5: 2048)
    # K: the LM's head on each conversation's first K answer tokens only (exchanges past K are
    # truncated like overlong ones); None: on every position. Saves most of a large vocabulary's cost.
    c.model.loss_positions = config_dict.placeholder(int)
    c.model.loss_chunk = config_dict.placeholder(int)  # tokens whose logits are made at a time (None: all)

    c.lora = ml_collections.ConfigDict(dict(rank=0, alpha=config_dict.placeholder(float),  # unset: 2 x rank
                                            dropout=0.05,
                                            targets=(r"language/block_\d+/attn/(q|k|v|o)",)))
    c.optim = common.optim(lr=1e-3, warmup_steps=min(max(arg.steps * 3 // 100, 1), arg.steps - 1), weight_decay=0.0,
                           b2=0.999, eps=1e-8,  # LLaVA trains with transformers' Trainer's AdamW defaults
                           freeze=(r"tower/.*", r"language/.*"))  # stage 1: the connector alone
    c.init = common.init(vision=config_dict.placeholder(str),  # a vitmm.train CLIP workdir or vitmm.interop folder
                         lm=config_dict.placeholder(str),  # a `python -m vitmm.interop --from hf|gguf` LM folder
                         allow_random_tower=False)
    # Held-out conversations (e.g. --config.evals.val.data.data_path=val.json): the answer-token loss.
    c.evals = ml_collections.ConfigDict()
    c.evals.val = dict(type="val_loss", data=common.raw_data(split="validation"), num_examples=500, batch_size=16)

    c.multihost = common.multihost()
    if arg.smoke:
        c.log_every, c.eval_every, c.checkpoint_every = 2, arg.steps, arg.steps
        c.input.image_size, c.input.num_threads = 32, 1
        c.model.lm.update(dict(width=32, depth=1))
        c.model.vision.depth = 2  # the fewest blocks that have a second-to-last (vision_layer=-2)
        c.model.max_len = 256
        c.optim.warmup_steps = min(1, arg.steps - 1)  # none in a one-step run
        c.evals.val.update(num_examples=8, batch_size=4)
        c.init.allow_random_tower = True
    c.lock()
    return c
