"""The ``scenes`` TFDS dataset: ``tfds.data_source("scenes/easy_64", data_dir=...)``.

Builder configs are ``{difficulty}_{resolution}`` for difficulties ``easy``, ``medium``, ``hard``
and resolutions 32, 64, 128, 224. Files are ``array_record`` (read with grain; TensorFlow is not
needed: images reach TFDS as PNG bytes encoded with Pillow). Building is offline and takes seconds
for the small configs; ``prepare`` builds a config the first time it is asked for.
"""

from __future__ import annotations

import dataclasses
import io
import pathlib
import re
import sys

import numpy as np
import tensorflow_datasets as tfds
from PIL import Image

from vitmm.data import scenes

RESOLUTIONS = (32, 64, 128, 224)
DEFAULT_DATA_DIR = "~/tensorflow_datasets"


@dataclasses.dataclass
class ScenesConfig(tfds.core.BuilderConfig):
    difficulty: str = "easy"
    resolution: int = 64
    num_train: int = 10_000
    num_validation: int = 1_000
    num_test: int = 1_000
    seed: int = 0


def make_config(difficulty: str, resolution: int, **sizes) -> ScenesConfig:
    """A config named ``{difficulty}_{resolution}``; ``sizes`` (``num_train``, ``num_validation``,
    ``num_test``, ``seed``) override the defaults and then name the config
    ``{difficulty}_{resolution}_{train}_{validation}_{test}_s{seed}`` so that it never shadows a
    standard build in the same ``data_dir``."""
    if difficulty not in scenes.DIFFICULTIES:
        raise ValueError(f"Unknown difficulty {difficulty!r}; choose one of {tuple(scenes.DIFFICULTIES)}.")
    large = resolution > 64  # larger images: fewer of them, so a build stays in seconds
    defaults = dict(num_train=4_000 if large else 10_000, num_validation=500 if large else 1_000,
                    num_test=500 if large else 1_000)
    defaults.update(sizes)
    name = f"{difficulty}_{resolution}"
    if sizes:
        name += (f"_{defaults['num_train']}_{defaults['num_validation']}_{defaults['num_test']}"
                 f"_s{defaults.get('seed', 0)}")
    return ScenesConfig(
        name=name, difficulty=difficulty, resolution=resolution,
        description=f"{difficulty} scenes at {resolution}x{resolution}", **defaults,
    )


def _png(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


class Scenes(tfds.core.GeneratorBasedBuilder):
    """Synthetic scenes of coloured shapes with captions, labels, facts and questions."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "First release."}
    BUILDER_CONFIGS = [make_config(d, r) for d in scenes.DIFFICULTIES for r in RESOLUTIONS]
    DEFAULT_CONFIG_NAME = "easy_64"

    def _info(self) -> tfds.core.DatasetInfo:
        cfg = self.builder_config
        diff = scenes.DIFFICULTIES[cfg.difficulty]
        res = cfg.resolution
        features = tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(res, res, 3), encoding_format="png"),
            "caption": tfds.features.Text(),
            # Index into metadata["label_names"] for single-shape images, -1 for several shapes.
            "label": tfds.features.Scalar(dtype=np.int64),
            "objects": tfds.features.Sequence({
                "shape": tfds.features.ClassLabel(names=scenes.SHAPES),
                "color": tfds.features.ClassLabel(names=tuple(scenes.COLORS)),
                "size": tfds.features.ClassLabel(names=scenes.SIZES),
                "region": tfds.features.ClassLabel(names=scenes.REGIONS),
                "x": tfds.features.Scalar(dtype=np.float32),
                "y": tfds.features.Scalar(dtype=np.float32),
            }),
            "shape_counts": tfds.features.Tensor(shape=(len(diff.shapes),), dtype=np.int64),
            "color_counts": tfds.features.Tensor(shape=(len(diff.colors),), dtype=np.int64),
            "questions": tfds.features.Sequence(tfds.features.Text()),
            "answers": tfds.features.Sequence(tfds.features.Text()),
            "question_kinds": tfds.features.Sequence(tfds.features.ClassLabel(names=scenes.QUESTION_KINDS)),
        })
        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                "Synthetic scenes of 1-{n} coloured shapes ({shapes}) on a {bg} background, {place}, "
                "with a caption saying what is where, a shape label for single-shape images, "
                "per-object facts and question/answer pairs (exists, count, colour/shape at a "
                "location, relative position). Generated offline by vitmm."
            ).format(n=diff.max_shapes, shapes=", ".join(diff.shapes),
                     bg="noisy" if diff.noisy_background else "plain",
                     place=f"on a {diff.grid}x{diff.grid} grid" if diff.grid else "placed freely"),
            features=features,
            metadata=tfds.core.MetadataDict(
                label_names=list(diff.shapes), color_names=list(diff.colors),
                difficulty=cfg.difficulty, resolution=res, seed=cfg.seed,
            ),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing is downloaded
        cfg = self.builder_config
        return {
            "train": self._generate_examples("train", cfg.num_train),
            "validation": self._generate_examples("validation", cfg.num_validation),
            "test": self._generate_examples("test", cfg.num_test),
        }

    def _generate_examples(self, split: str, num_examples: int):
        cfg = self.builder_config
        for index in range(num_examples):
            ex = scenes.generate(cfg.difficulty, cfg.resolution, index, split, cfg.seed)
            ex["image"] = _png(ex["image"])
            if self._bar is not None:
                self._bar.update()
            yield index, ex

    # TFDS says "Downloading and preparing dataset ..." and draws a bar per split and stage; a
    # scenes build downloads nothing, so it says "generating" once, with one bar over every example.
    _bar = None

    def _log_download_bytes(self) -> None:
        from tqdm import tqdm

        cfg = self.builder_config
        self._bar = tqdm(total=cfg.num_train + cfg.num_validation + cfg.num_test, unit="example", file=sys.stderr,
                         desc=f"generating scenes/{cfg.name} in {self.data_dir}", leave=False)

    def _log_download_done(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        print(f"generated scenes/{self.builder_config.name} in {self.data_dir}", file=sys.stderr, flush=True)


_NAME = re.compile(r"^(?P<d>[a-z]+(?:-[a-z]+)?)_(?P<r>\d+)(?:_(?P<tr>\d+)_(?P<va>\d+)_(?P<te>\d+)_s(?P<s>\d+))?$")


def config_from_name(name: str) -> ScenesConfig:
    """``"easy_64"`` or ``"{difficulty}_{resolution}_{train}_{validation}_{test}_s{seed}"``."""
    match = _NAME.match(name)
    if not match or match["d"] not in scenes.DIFFICULTIES or int(match["r"]) < 16:
        known = [c.name for c in Scenes.BUILDER_CONFIGS]
        raise ValueError(
            f"Unknown scenes config {name!r}; use DIFFICULTY_RESOLUTION (e.g. {known[:3]}…, "
            "difficulty in " f"{tuple(scenes.DIFFICULTIES)}, resolution >= 16), optionally with "
            "split sizes and seed: 'easy_32_1000_100_100_s0'."
        )
    if match["tr"] is None:
        return make_config(match["d"], int(match["r"]))
    return make_config(match["d"], int(match["r"]), num_train=int(match["tr"]),
                       num_validation=int(match["va"]), num_test=int(match["te"]), seed=int(match["s"]))


def prepare(config: str | ScenesConfig = "easy_64", data_dir: str | None = None) -> Scenes:
    """Returns the builder of a scenes config, building it into ``data_dir`` if needed."""
    data_dir = str(pathlib.Path(data_dir or DEFAULT_DATA_DIR).expanduser())
    if isinstance(config, str) and config not in {c.name for c in Scenes.BUILDER_CONFIGS}:
        config = config_from_name(config)  # raises for a bad name
    builder = Scenes(config=config, data_dir=data_dir, file_format="array_record")
    if not builder.is_prepared():
        from tensorflow_datasets.core.utils import tqdm_utils

        was_on = tqdm_utils._active  # noqa: SLF001 - TFDS has a setter, no getter
        tqdm_utils.display_progress_bar(False)
        try:
            builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
        finally:
            tqdm_utils.display_progress_bar(was_on)
    return builder
