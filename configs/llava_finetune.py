"""LLaVA stage 2 on your own data: multi-turn conversations (LLaVA's ``llava_v1_5_mix665k.json``
layout, text-only examples mixed in), the connector and the LM trained (or LoRA adapters on the LM),
starting from a stage-1 run of ``configs/llava_pretrain.py``; the tower stays frozen.

    python -m vitmm.train --config configs/llava_finetune.py:lora=8 --workdir workdirs/llava_s2 \\
        --config.input.data_path=/tmp/llava_demo/data.json --config.input.image_folder=/tmp/llava_demo \\
        --config.init.vision=workdirs/clip_scenes --config.init.lm=workdirs/smollm2 \\
        --config.init.checkpoint=workdirs/llava_s1
    python -m vitmm.chat --workdir workdirs/llava_s2 --image /tmp/llava_demo/images/000000.jpg \\
        --question "Describe the image."

Args: ``lora`` (a rank > 0: adapters on the LM's attention, the LM frozen; 0: the whole LM trains,
LLaVA-1.5's recipe), and those of ``configs/llava_pretrain.py`` (``connector``, ``budget``,
``steps``, ``batch``, ``smoke``, ``pack``, ``images``, ``frames``, ``temporal``, ``native``,
``anyres``). Learning rates as LLaVA-1.5: 2e-5 for the whole LM, 2e-4 with LoRA.
"""

from configs import common, llava_pretrain
from vitmm.config_args import parse_arg


def get_config(arg=None):
    arg = parse_arg(arg, presets=common.SMOKE_LLAVA_ARGS, lora=0, connector="mlp", budget="all", steps=1000,
                    batch=16, smoke=False, pack=0, images=1, frames=0, temporal=1, native=0, anyres=0)
    c = llava_pretrain.get_config(f"connector={arg.connector},budget={arg.budget},steps={arg.steps},"
                                  f"batch={arg.batch},smoke={arg.smoke},pack={arg.pack},images={arg.images},"
                                  f"frames={arg.frames},temporal={arg.temporal},native={arg.native},"
                                  f"anyres={arg.anyres}")
    with c.unlocked():
        c.lora.rank = arg.lora  # alpha: 2 x rank unless set
        c.optim.lr = 2e-4 if arg.lora else 2e-5
        if arg.lora:  # LLaVA-1.5's LoRA recipe: --learning_rate 2e-4 --mm_projector_lr 2e-5
            c.optim.lr_mult = ((r"project/.*", 0.1),)
        c.optim.freeze = (r"tower/.*", r"language/.*") if arg.lora else (r"tower/.*",)
        c.init.dont_load = (r"lora/.*",) if arg.lora else ()  # adapters start fresh after stage 1
        if arg.smoke:
            c.optim.lr = 1e-3
    return c
