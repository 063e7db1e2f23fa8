"""What every run of the token-budget sweep reads: the frozen tower's features of the train,
validation and test questions (``encode_features``), the encoder-side views included."""

from __future__ import annotations

import dataclasses
import pathlib
import time

from experiments.common import qa_features
from experiments.common import tower as tower_lib
from experiments.token_budget.views import encoder_views
from vitmm import checkpoint as ckpt_lib
from vitmm.models.vit import ViT
from vitmm.study import store


@dataclasses.dataclass
class Features:
    """The frozen tower and the question features every run of the sweep reads."""

    tower_dir: pathlib.Path
    tower_cfg: dict
    image_size: int
    data: str
    fingerprint: str  # the tower's parameters, pinned in OUT/tower.json
    grid: tuple
    encoder: dict  # the encoder-side views: {tokens: {variant: (view, tower, params, image size)}}
    tokenizer: object
    max_len: int
    splits: dict  # {"train" | "val" | "test": arrays}


def encode_features(args, out: pathlib.Path) -> Features:
    """The tower (trained or pinned first when missing; another tower than OUT's is refused) and
    its features of the train, validation and test questions, the encoder-side views included."""
    tower_dir = tower_lib.tower_dir(args.tower, out, args.smoke, args.data_dir)
    clip_config = ckpt_lib.load_config(tower_dir)
    tower_cfg = clip_config["model"]["image"]
    image_size = clip_config["input"]["image_size"]
    data = args.data or clip_config["input"].get("data", {}).get("name")
    if data is None:  # e.g. a tower converted with python -m vitmm.interop
        args.parser.error(f"{tower_dir} does not say what data it was trained on; pass --data (e.g. scenes/easy_224).")
    tower = ViT(**tower_cfg)
    tower_params = ckpt_lib.load_params(tower_dir)["img"]
    fingerprint = store.check_tower(out, tower_dir, tower_params)
    grid = tower.grid((image_size, image_size))
    enc = encoder_views(tower_cfg, tower_params, image_size, grid, args.encoder_budgets)
    views = {name: (t, p, size) for vs in enc.values() for name, t, p, size in vs.values()}

    t0 = time.perf_counter()
    tokenizer, max_len = qa_features.make_tokenizer(args.tokenizer, data, args.data_dir)
    splits = {}
    for name, split, n in (("train", "train", args.train_images), ("val", "validation", args.val_images),
                           ("test", "test", args.test_images or args.val_images)):
        splits[name] = qa_features.encode_split(tower, tower_params, data, split, n, image_size, tokenizer, max_len,
                                                args.data_dir, views=views)
    train, val, test = splits["train"], splits["val"], splits["test"]
    print(f"tower features: {len(train['patches'])} train / {len(val['patches'])} validation / {len(test['patches'])} "
          f"test images, grid {grid}, {train['patches'].shape[-1]} channels, encoder-side views {sorted(views)}; "
          f"{len(train['ids'])} / {len(val['ids'])} / {len(test['ids'])} questions ({time.perf_counter() - t0:.0f} s)")
    return Features(tower_dir, tower_cfg, image_size, data, fingerprint, grid, enc, tokenizer, max_len, splits)
