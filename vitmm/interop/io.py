"""Reading and writing tensors and configs of other codebases: safetensors, ``.npz``, and
PyTorch ``.bin`` through ``torch.load(weights_only=True)`` when PyTorch is installed (never
unpickling code)."""

from __future__ import annotations

import json
import pathlib

import numpy as np

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "open_clip_model.safetensors", "open_clip_pytorch_model.bin")


def weights_path(src: str | pathlib.Path) -> pathlib.Path:
    """The weights file of ``src``: the file itself, or the known file name inside a folder."""
    src = pathlib.Path(src).expanduser()
    if src.is_file():
        return src
    if src.is_dir():
        for name in WEIGHT_FILES:
            if (src / name).is_file():
                return src / name
        if (src / "model.safetensors.index.json").is_file():
            return src / "model.safetensors.index.json"  # shards, listed by the index
        raise FileNotFoundError(f"No weights in {src}: expected one of {WEIGHT_FILES}.")
    raise FileNotFoundError(f"{src} does not exist (vitmm only reads local files; nothing is downloaded).")


def read_tensors(src: str | pathlib.Path) -> dict[str, np.ndarray]:
    """``{name: float32/int array}`` from a safetensors, npz or PyTorch file (or a folder)."""
    path = weights_path(src)
    if path.name.endswith(".safetensors.index.json"):
        return _read_shards(path)
    if path.suffix not in (".safetensors", ".npz", ".bin", ".pt", ".pth"):
        raise ValueError(f"Unknown weights format {path.suffix!r} for {path}; expected .safetensors, .npz or .bin.")
    if path.suffix in (".bin", ".pt", ".pth"):
        try:
            import torch
        except ImportError:
            raise ValueError(f"{path} is a PyTorch file; reading it needs PyTorch installed (it is read with "
                             "weights_only=True, never unpickling code), or convert it to safetensors "
                             "first.") from None
    try:
        if path.suffix == ".safetensors":
            import ml_dtypes  # noqa: F401 - registers bfloat16 with NumPy (released VLMs' weights), as JAX does
            from safetensors.numpy import load_file

            return {k: np.asarray(v) for k, v in load_file(str(path)).items()}
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as data:
                return {k: data[k] for k in data.files}
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any reader's failure: name the file and the likely cause
        raise ValueError(f"{path} could not be read ({type(err).__name__}: {str(err).strip()[:200]}); the file may "
                         "be truncated or not what its name says: copy it again.") from err
    state = state.get("state_dict", state)
    return {k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in state.items()}


def _read_shards(index: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of a sharded safetensors checkpoint (``model.safetensors.index.json``)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError) as err:
        raise ValueError(f"{index} is not a safetensors index (no weight_map): {err}") from None
    missing = sorted({f for f in weight_map.values() if not (index.parent / f).is_file()})
    if missing:
        raise FileNotFoundError(f"{index} names shards that are not in {index.parent}: {missing}; copy them there.")
    tensors: dict[str, np.ndarray] = {}
    for shard in dict.fromkeys(weight_map.values()):
        tensors.update(read_tensors(index.parent / shard))
    return tensors


def read_json(src: str | pathlib.Path, name: str = "config.json") -> dict:
    path = pathlib.Path(src).expanduser()
    path = path / name if path.is_dir() else path.with_name(name)
    if not path.is_file():
        raise FileNotFoundError(f"No {name} next to the weights in {path.parent}.")
    return json.loads(path.read_text())


def generation_config(src: str | pathlib.Path) -> dict:
    """A transformers folder's ``generation_config.json`` (where instruct models list every id that
    ends a turn as ``eos_token_id``), or {} without one."""
    try:
        return read_json(src, "generation_config.json")
    except FileNotFoundError:
        return {}


def chat_template(folder: pathlib.Path) -> str | None:
    """A transformers folder's chat template: ``chat_template.jinja`` (transformers 5),
    ``chat_template.json`` or ``tokenizer_config.json``'s ``chat_template`` (older saves); None without one.
    Where that is a list of named templates (``[{"name": "default", "template": ...}, {"name": "tool_use",
    ...}]``), the one named "default", which transformers applies when no tools are passed."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    for name in ("chat_template.json", "tokenizer_config.json"):
        if (folder / name).is_file():
            template = json.loads((folder / name).read_text()).get("chat_template")
            if isinstance(template, list):
                named = {t["name"]: t["template"] for t in template}
                if "default" not in named:
                    raise ValueError(f"{folder / name} holds chat templates named {sorted(named)} and none named "
                                     "'default', the one vitmm (as transformers without tools) applies; write the "
                                     "one to use to chat_template.jinja in that folder.")
                template = named["default"]
            if template:
                return template
    return None


def write_safetensors(tensors: dict[str, np.ndarray], path: str | pathlib.Path) -> None:
    from safetensors.numpy import save_file

    path = pathlib.Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)  # never a half-written file under the final name
