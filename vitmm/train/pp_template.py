"""A run's pp template filled from its config: ``{image_size}``, ``{max_len}``, the images'
normalisation (the run's, or what the tower checkpoint records), the tower's ``{patch_size}``, the
``{anyres}`` op of a VLM with AnyRes views; the split of the pp between host and device
(``input.device_normalize``) and the channels the tower sees."""

from __future__ import annotations

from vitmm import checkpoint as ckpt_lib
from vitmm.data import preprocess
from vitmm.train import sources


def image_channels(config) -> int:
    """The channels of the images the tower sees: 3, times the pp's ``temporal_patch`` size."""
    sizes = [(a[0] if a else kw.get("size", 2)) for name, a, kw in preprocess.ops(pp_string(config))
             if name == "temporal_patch"]
    return 3 * (sizes[0] if sizes else 1)


def image_normalization(config) -> tuple[tuple, tuple]:
    """``(mean, std)`` the run's images are normalised with, each on its own: ``input.image_mean``
    / ``image_std`` when set, else what the tower's checkpoint records (``init.vision`` for a VLM,
    ``init.checkpoint`` for a two-tower run, e.g. a converted OpenAI CLIP), else 0.5
    (``value_range(-1, 1)``, what vitmm's own configs train with)."""
    mean, std = config.input.get("image_mean"), config.input.get("image_std")
    recorded = _recorded_normalization(config) if mean is None or std is None else {}
    half = (0.5, 0.5, 0.5)
    return tuple(mean or recorded.get("image_mean") or half), tuple(std or recorded.get("image_std") or half)


def _recorded_normalization(config) -> dict:
    """The ``image_mean``/``image_std`` the tower's checkpoint records (``init.vision``'s for a VLM,
    ``init.checkpoint``'s for a two-tower run)."""
    folder = sources.folder(config, "vision" if config.get("task") == "vlm" else "checkpoint")
    return (ckpt_lib.load_config(folder).get("input") or {}) if folder else {}


def normalize_op(config) -> str:
    """The ``{normalize}`` op: ``value_range(-1, 1)`` for the 0.5/0.5 statistics (the same float
    ops as vitmm's configs have always run), else ``normalize(mean, std)``."""
    mean, std = image_normalization(config)
    return "value_range(-1, 1)" if mean == std == (0.5, 0.5, 0.5) else f"normalize({mean}, {std})"


def value_op(config) -> str:
    """The run's pp's final ``value_range``/``normalize`` op, as its evaluators must repeat it (the
    ``{normalize}`` op when the pp has none)."""
    spec = pp_string(config)
    found = [(name, args, kwargs) for name, args, kwargs in preprocess.ops(spec)
             if name in ("value_range", "normalize") and kwargs.get("key", "image") == "image"]
    if not found:
        return normalize_op(config)
    name, args, kwargs = found[-1]
    return f"{name}({', '.join([repr(a) for a in args] + [f'{k}={v!r}' for k, v in kwargs.items()])})"


def pp_string(config, template: str | None = None) -> str:
    """A pp template (default ``config.input.pp``) with its fields filled from the config:
    ``{image_size}`` (``input.image_size``), ``{max_len}`` (the LM's ``model.max_len`` or the
    text tower's ``model.text.max_len``), ``{image_mean}`` and ``{image_std}``
    (``image_normalization``), ``{normalize}`` (``normalize_op``), ``{loss_positions}``
    (``model.loss_positions``)."""
    template = config.input.pp if template is None else template
    fields = dict(image_size=config.input.image_size,
                  max_len=config.model.get("max_len") or config.model.get("text", {}).get("max_len"),
                  max_num_patches=(config.input.get("packing") or config.input.get("sequences") or {}).get(
                      "max_num_patches"),
                  patch_size=(config.model.get("image") or {}).get("patch_size"),
                  loss_positions=config.model.get("loss_positions"))
    if "{patch_size}" in template and config.get("task") == "vlm":  # the tower's, init.vision's where it comes from
        from vitmm.models.patch_embed import to_pair
        from vitmm.models.vit import ViT
        from vitmm.train import vlm_start

        fields["patch_size"] = to_pair(ViT(**vlm_start.vlm_parts(config)[0]).arch().patch_size)[0]
    if "{anyres}" in template:
        fields["anyres"] = anyres_op(config)
    if "{normalize}" in template:
        fields["normalize"] = normalize_op(config)
    if "{image_mean}" in template or "{image_std}" in template:
        mean, std = image_normalization(config)
        fields.update(image_mean=mean, image_std=std)
    try:
        return template.format(**fields)
    except (KeyError, IndexError) as err:
        raise ValueError(f"The pp template {template!r} names the field {err}; a pp template may use "
                         f"{{image_size}}, {{max_len}}, {{image_mean}}, {{image_std}}, {{normalize}}, "
                         "{max_num_patches}, {patch_size}, {loss_positions} and {anyres} only.") from None


def host_pp_and_device_affine(config) -> tuple[str, tuple | None]:
    """The training pp the host runs, and the per-channel ``(scale, offset)`` the device applies to
    the uint8 images (``input.device_normalize``; else None and the pp as it is)."""
    spec = pp_string(config)
    if not config.input.get("device_normalize"):
        return spec, None
    if config.input.get("packing"):
        raise ValueError("input.device_normalize works on image batches, not packed patches (input.packing); "
                         "set it to False.")
    if (config.input.get("sequences") or {}).get("tower_length"):
        raise ValueError("input.device_normalize works on image batches, not the tower's packed patches "
                         "(input.sequences.tower_length); set it to False.")
    host, affine = preprocess.split_image_affine(spec)
    if affine is None:
        raise ValueError(f"input.device_normalize=True, but the pp {spec!r} does not end its image work with "
                         "value_range or normalize (e.g. blank comes after it); set it to False.")
    return host, affine


def anyres_op(config) -> str:
    """The ``anyres`` preprocessing op of a VLM with ``model.anyres``: its tiles, candidate
    resolutions and the connector's token grid on a tile (what each view hands the LM)."""
    from vitmm.models import connectors
    from vitmm.models.vit import ViT
    from vitmm.train import vlm_start

    settings = config.model.get("anyres")
    if not settings:
        raise ValueError("The pp template uses {anyres}, but model.anyres is not set.")
    tile = int(settings["tile"])
    tower_grid = ViT(**vlm_start.vlm_parts(config)[0]).grid((tile, tile))
    tile_grid = connectors.token_grid(config.model.connector.to_dict(), tower_grid)
    if tile_grid is None:
        raise ValueError(f"model.anyres needs a grid-shaped connector; {config.model.connector.name!r} hands the LM "
                         "learned queries with no place in the image.")
    return f"anyres({[tuple(p) for p in settings['pinpoints']]}, {tile}, {tuple(tile_grid)})"
