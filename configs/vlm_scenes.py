"""A small VLM on scenes questions: the CLIP tower of `configs/clip_scenes.py`, a connector under
a token budget, and a 4-layer Llama-style LM on bytes.

    python -m vitmm.train --config configs/clip_scenes.py --workdir workdirs/clip_scenes   # the tower
    python -m vitmm.train --config configs/vlm_scenes.py:connector=pool,budget=16,stage=1 \\
        --workdir workdirs/vlm_pool16_s1 --config.init.vision=workdirs/clip_scenes
    python -m vitmm.train --config configs/vlm_scenes.py:connector=pool,budget=16,stage=2 \\
        --workdir workdirs/vlm_pool16_s2 --config.init.vision=workdirs/clip_scenes \\
        --config.init.checkpoint=workdirs/vlm_pool16_s1
    python -m vitmm.train --config configs/vlm_scenes.py:smoke --workdir /tmp/vlm_smoke

Args: ``connector`` (a name in ``vitmm.models.connectors.REGISTRY``), ``budget`` (visual tokens,
or ``all``), ``stage`` (1: connector only; 2: connector and LM, as LLaVA; the tower stays
frozen), ``lora`` (a rank > 0: LoRA adapters on the LM's attention instead of training it),
``chat`` (prompts in the chat template of the LM of ``init.lm``), ``blind`` (images blanked:
the no-image baseline), ``mrope`` (Qwen2-VL's 3D positions for the visual tokens, the LM's
rotary bands split by ``rope.mrope_split``; a grid-shaped connector), ``anyres`` (a tile side in
pixels: LLaVA-NeXT's base view + tiles of 1×2, 2×1 or 2×2 tiles, a newline per row, made on the
host by the ``anyres`` op at each image's own size; a grid-shaped connector), ``any_size``
(scenes at random sizes and aspect ratios, made on the fly: ``input.scenes_any``; training and
evaluation), ``steps``, ``data`` (a scenes config), ``smoke``.

    python -m vitmm.train --config configs/vlm_scenes.py:connector=mlp,anyres=32,any_size=True \
        --workdir workdirs/vlm_anyres --config.init.vision=workdirs/clip_scenes
"""

import ml_collections
from ml_collections import config_dict

from configs import common
from vitmm.config_args import given, parse_arg

TOWER = dict(width=128, depth=4, mlp_dim=512, num_heads=4, patch_size=8, pool="gap", class_token=False,
             posemb="sincos2d")  # must match configs/clip_scenes.py's image tower


def get_config(arg=None):
    arg = parse_arg(arg, presets=common.SMOKE_ARGS,
                    connector="mlp", budget="all", stage=1, steps=500, data="easy_64", lora=0, chat=False, blind=False,
                    mrope=False, anyres=0, any_size=False, smoke=False)
    if arg.stage not in (1, 2):
        raise ValueError(f"stage must be 1 (connector only) or 2 (connector and LM), got {arg.stage}.")
    c = ml_collections.ConfigDict()
    c.task = "vlm"
    c.seed = 0
    c.deterministic = False  # True: a GPU run repeats bit for bit (vitmm/train/determinism.py)
    c.total_steps = arg.steps
    c.batch_size = 64  # (image, question, answer) examples per step
    c.parallel = "jit"
    c.fsdp = False
    c.tensor_parallel = 1  # devices a layer's projections are split over (a `model` mesh axis)
    c.tokenizer = config_dict.placeholder(str)  # default: bytes
    c.log_every = 10
    c.eval_every = c.checkpoint_every = arg.steps
    c.keep_checkpoints = 2
    c.allow_config_change = False  # resume even where the config changes what the run computes
    c.sync_every = 8

    # One question per image (choose); the images normalised as the tower was trained
    # ({image_mean}/{image_std}: input.image_mean/std, else what init.vision records).
    # chat: the question in the LM's chat template (init.lm's) after a short system turn, the
    # image where <image> stands. blind: every image blanked (the no-image baseline).
    # anyres: each image's views and their layout made on the host at its own size ({anyres}:
    # the model's tiles, candidates and the connector's grid per tile), padded to the most views.
    qa = ("decode|" + ("{anyres}" if arg.anyres else "resize({image_size})") + "|normalize({image_mean}, {image_std})|"
          + ("blank|" if arg.blind else "") + "choose|"
          + ("qa_tokens({max_len}, chat=True, system='Answer with one word or number.', max_answer={loss_positions})"
             if arg.chat else "qa_tokens({max_len}, max_answer={loss_positions})"))
    anyres_keys = ", 'visual_mask', 'anyres_layout'" if arg.anyres else ""
    c.input = common.train_input(f"scenes/{arg.data}", image_size=64,
                                 keys=("image", "questions", "answers", "question_kinds"),
                                 pp=f"{qa}|keep('image', 'ids', 'answer_mask', 'prompt_len', 'image_pos'{anyres_keys})")
    c.input.image_mean = config_dict.placeholder(tuple)
    c.input.image_std = config_dict.placeholder(tuple)

    c.model = ml_collections.ConfigDict()
    c.model.vision = dict(TOWER, **common.kernels())
    c.model.connector = dict(name=arg.connector, budget=arg.budget if arg.budget == "all" else int(arg.budget))
    c.model.lm = dict(vocab_size=259, width=128, depth=4, num_heads=4,
                      **common.kernels(remat_policy=config_dict.placeholder(str)))
    c.model.vision_layer = -1  # -1: the tower's output; -n: HF's hidden_states[-n]
    c.model.use_cls = False
    c.model.prefix_lm = False  # True: image and prompt attend both ways
    c.model.mrope = arg.mrope  # Qwen2-VL's (temporal, height, width) positions for the visual tokens
    tile = arg.anyres  # AnyRes: the image as a base view + tiles of the best candidate resolution
    c.model.anyres = dict(tile=tile, pinpoints=((tile, 2 * tile), (2 * tile, tile), (2 * tile, 2 * tile))) if tile \
        else None
    c.model.max_len = 64  # BOS + question + answer + EOS, in tokens
    # K: the LM's head runs on the first K answer tokens of each example only (the pp's qa_tokens
    # refuses a longer answer); None: on every position. What a large vocabulary needs.
    c.model.loss_positions = config_dict.placeholder(int)
    c.model.loss_chunk = config_dict.placeholder(int)  # tokens whose logits are made at a time (None: all)

    # Stage 1 trains the connector; stage 2 the connector and the LM, or with lora=R > 0 the
    # connector and rank-R adapters on the LM's attention projections (the LM itself frozen).
    freeze = (r"tower/.*", r"language/.*") if arg.stage == 1 or arg.lora else (r"tower/.*",)
    c.lora = ml_collections.ConfigDict(dict(rank=arg.lora, alpha=config_dict.placeholder(float),  # unset: 2 x rank
                                            dropout=0.05,
                                            targets=(r"language/block_\d+/attn/(q|k|v|o)",)))
    c.optim = common.optim(lr=1e-3 if arg.stage == 1 else 3e-4,
                           warmup_steps=min(max(arg.steps // 20, 1), arg.steps - 1), weight_decay=0.0, freeze=freeze)
    # The tower and (with init.lm) the LM are built from the settings saved with their checkpoints;
    # model.vision / model.lm only say what a run without them uses.
    c.init = common.init(dont_load=(r"lora/.*",) if arg.lora else (),  # adapters start fresh after stage 1
                         vision=config_dict.placeholder(str),  # a vitmm.train CLIP workdir or vitmm.interop folder
                         lm=config_dict.placeholder(str),  # a `python -m vitmm.interop --from hf|gguf` LM folder
                         allow_random_tower=False)  # stage 2: also init.checkpoint = the stage-1 workdir

    c.evals = ml_collections.ConfigDict()
    c.evals.qa = dict(type="qa", data=common.data_spec(f"scenes/{arg.data}", "validation"), pp=qa,
                      num_examples=512, batch_size=128, max_new_tokens=8)
    if arg.any_size:  # scenes at random sizes (longer side 32-160 px, aspect up to 3), made on the fly
        c.input.scenes_any = ml_collections.ConfigDict(dict(
            difficulty=arg.data.split("_")[0], num_examples=20_000, split="train", seed=0, min_side=32,
            max_side=160, max_aspect=3.0))
        c.evals.qa.data = dict(name="scenes_any", split="validation", scenes_any=dict(
            c.input.scenes_any.to_dict(), num_examples=512))

    c.multihost = common.multihost()
    if arg.smoke:
        common.smoke(c, steps=arg.steps, batch_size=8, given=given(arg))
        c.model.lm.update(dict(width=32, depth=1))
        c.evals.qa.num_examples, c.evals.qa.batch_size = 16, 8
        if arg.any_size:
            c.input.scenes_any.num_examples = 64
        c.init.allow_random_tower = True
    c.lock()
    return c
