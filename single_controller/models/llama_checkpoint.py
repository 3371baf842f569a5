"""One Llama layer's MLP weights in a Hugging Face safetensors checkpoint, read slice by slice.

A checkpoint is a ``.safetensors`` file, or a directory of shards with or without a
``*.safetensors.index.json`` (its ``weight_map`` names the shard of each tensor). Opening
one reads only the headers: names, dtypes and shapes. The tensor-parallel ranks then ask
for their own rows or columns (``get_slice``): safetensors 0.8 answers with a view of the
memory-mapped file, and a rank copies just its slice from it into its parameter, so it
never holds a full matrix and reads only the file pages its slice lies in. (Row slices of
gate and up are contiguous; a column slice of down is a part of every row of down, so
with page rounding a rank reads somewhat more of down than its tp-th.) A view keeps the
file mapped, so the layer copies a matrix a block of rows at a time.

Given ``allowed_dirs``, every file the reader opens (the index, each shard, the file named
directly) is resolved, symlinks followed, and refused unless it lies inside one of them: a
shard that links out of an allowed directory is not read.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

#: Hugging Face Llama's names of the three MLP matrices of layer ``i``.
GATE, UP, DOWN = "gate_proj", "up_proj", "down_proj"
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
#: safetensors dtypes a layer can be cast from (the layer computes in float32).
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


def tensor_name(layer_index: int, proj: str) -> str:
    return f"model.layers.{layer_index}.mlp.{proj}.weight"


class _Readable:
    """Resolves the paths a checkpoint reads and refuses those outside the allowed
    directories (None: any path)."""

    def __init__(self, allowed_dirs: Sequence[str | os.PathLike[str]] | None) -> None:
        if allowed_dirs is not None and (
            isinstance(allowed_dirs, (str, bytes, os.PathLike))
            or not all(isinstance(d, (str, os.PathLike)) for d in allowed_dirs)
        ):
            raise ValueError(f"allowed_dirs must be a list of directories, got {allowed_dirs!r}")
        self.dirs = None if allowed_dirs is None else [Path(d).resolve() for d in allowed_dirs]

    def __call__(self, path: Path) -> Path:
        real = path.resolve()
        if self.dirs is not None and not any(real.is_relative_to(d) for d in self.dirs):
            allowed = ", ".join(str(d) for d in self.dirs) or "none"
            shown = str(path) if real == path else f"{path} (resolved: {real})"
            raise ValueError(f"checkpoint file {shown} is outside the directories this layer may read ({allowed})")
        return real


def _shard_files(root: Path, readable: _Readable) -> dict[str, Path]:
    """Tensor name -> file (resolved, and allowed), for a file or a directory (from its
    index json, else its headers)."""
    if root.is_file():
        return {name: root for name in _header_names(root)}
    indexes = sorted(root.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise ValueError(f"checkpoint {root} has several index files: {', '.join(p.name for p in indexes)}")
    if indexes:
        return _from_index(root, readable(indexes[0]), readable)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"checkpoint directory {root} holds no .safetensors file")
    names: dict[str, Path] = {}
    for file in files:
        real = readable(file)
        for name in _header_names(real):
            names.setdefault(name, real)
    return names


def _from_index(root: Path, index: Path, readable: _Readable) -> dict[str, Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{index} is not a safetensors index (a JSON object with weight_map): {exc}") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: weight_map must be an object of tensor name -> file name")
    names: dict[str, Path] = {}
    resolved: dict[str, Path] = {}
    for name, file_name in weight_map.items():
        # Shards sit beside the index: a name that leads elsewhere is refused, not followed.
        if not isinstance(file_name, str) or Path(file_name).name != file_name:
            raise ValueError(f"{index}: {name!r} maps to {file_name!r}, not a file name in {root}")
        if file_name not in resolved:
            resolved[file_name] = readable(root / file_name)
        names[name] = resolved[file_name]
    return names


def _header_names(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt") as handle:
            return list(handle.keys())
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{file} is not a readable safetensors file: {exc}") from None


class LlamaMLPCheckpoint:
    """Layer ``layer_index``'s ``gate_proj``, ``up_proj`` and ``down_proj`` in ``path``.

    The constructor checks names, shapes and dtypes from the headers alone; then
    ``hidden_size`` and ``intermediate_size`` are the layer's sizes, and ``read`` gives
    a rank's part of a matrix. With ``allowed_dirs`` (None: anywhere), ``path`` and every
    file read for it must resolve inside one of those directories.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        layer_index: int,
        allowed_dirs: Sequence[str | os.PathLike[str]] | None = None,
    ) -> None:
        if isinstance(layer_index, bool) or not isinstance(layer_index, int):
            raise ValueError(f"layer_index must be an integer, got {layer_index!r}")
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ValueError(f"checkpoint must be a path, got {path!r}")
        readable = _Readable(allowed_dirs)
        root = readable(Path(path))
        if not root.exists():
            raise ValueError(f"checkpoint {root} does not exist")
        self.path, self.layer_index = root, layer_index
        files = _shard_files(root, readable)
        layers = sorted({int(m.group(1)) for name in files if (m := _LAYER_KEY.match(name))})
        if not layers:
            raise ValueError(f"checkpoint {root} has no model.layers.* tensors (not a Hugging Face Llama layout)")
        if layer_index not in layers:
            raise ValueError(
                f"layer_index {layer_index} out of range: checkpoint {root} has layers {layers[0]}..{layers[-1]}"
            )
        missing = [tensor_name(layer_index, p) for p in (GATE, UP, DOWN) if tensor_name(layer_index, p) not in files]
        if missing:
            raise ValueError(f"checkpoint {root} lacks {', '.join(missing)}")
        biases = [n for n in files if n.startswith(f"model.layers.{layer_index}.mlp.") and n.endswith(".bias")]
        if biases:
            raise ValueError(f"checkpoint {root} has MLP biases ({', '.join(sorted(biases))}); the layer has none")
        self._files = {p: files[tensor_name(layer_index, p)] for p in (GATE, UP, DOWN)}
        shapes = {p: self._header(p) for p in (GATE, UP, DOWN)}
        gate, up, down = shapes[GATE], shapes[UP], shapes[DOWN]
        if len(gate) != 2 or gate != up or down != [gate[1], gate[0]]:
            raise ValueError(
                f"checkpoint {root} layer {layer_index}: gate_proj {gate}, up_proj {up} and down_proj {down} "
                "are not [intermediate, hidden], [intermediate, hidden] and [hidden, intermediate]"
            )
        self.intermediate_size, self.hidden_size = gate

    def _header(self, proj: str) -> list[int]:
        name, file = tensor_name(self.layer_index, proj), self._files[proj]
        try:
            with safe_open(str(file), framework="pt") as handle:
                if name not in handle.keys():
                    raise ValueError(f"{file} lacks {name} (named there by the checkpoint's index)")
                sliced = handle.get_slice(name)
                dtype, shape = sliced.get_dtype(), list(sliced.get_shape())
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{file} is not a readable safetensors file: {exc}") from None
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} is {dtype}; the layer loads {', '.join(sorted(_FLOAT_DTYPES))}")
        return shape

    def read(self, proj: str, rows: slice, columns: slice = slice(None)) -> torch.Tensor:
        """``proj[rows, columns]`` (GATE and UP are ``[intermediate, hidden]``, DOWN ``[hidden,
        intermediate]``) in the file's dtype.

        With safetensors' mmap backend this is a view of the mapped file that outlives the
        ``with``: copy from it (``param.copy_`` also casts) and drop it; only the pages copied
        are read. Each call maps the file anew, so reading a matrix in blocks of rows holds
        one block's pages at a time."""
        with safe_open(str(self._files[proj]), framework="pt") as handle:
            return handle.get_slice(tensor_name(self.layer_index, proj))[rows, columns]
