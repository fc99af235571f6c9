"""Checkpoint: every tensor of an HF safetensors directory as a lazy view, read only when touched.

    ckpt = open_checkpoint(directory)        # headers of all shards read and validated; no data read
    ckpt.shape(name), ckpt.dtype(name)        # from the header (BF16 is ml_dtypes.bfloat16)
    view = ckpt[name]                         # read-only numpy view in the checkpoint dtype
    part = view[rows] or view[:, cols]        # slicing reads only the pages of the slice
    to_device(part, xp, dtype)                # the conversion/upload step (models/weight_upload.py)

Views are separate from conversion so that a caller (tensor parallel) can slice rows or columns of a
view before converting it. Each view of a tensor of 1 MiB or more has its own memory map, unmapped
when the view and everything sliced from it are dropped, so a loader that converts tensor by tensor
holds at most one tensor's file pages at a time. Smaller tensors are read into memory. A view stays
valid while the file exists; rewriting a shard in place under a live view is undefined (SIGBUS).

Shards: `model.safetensors.index.json` when present (each listed shard once), else every
`*.safetensors` in the directory. A tensor in two shards, a missing shard, or a directory holding
only pickle checkpoints is refused, naming the files.
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from .safetensors_io import SafetensorsFile, TensorEntry


class Checkpoint(Mapping):
    """name -> lazy view (`SafetensorsFile.view`) over the shards of one directory.

    `files[name]` is the shard holding tensor `name`; every header was validated on open."""

    def __init__(self, files: list[SafetensorsFile]):
        self.shards = files
        self.files: dict[str, SafetensorsFile] = {}
        for file in files:
            for name in file.entries:
                if name in self.files:
                    raise ValueError(f"{file.path}: tensor {name} is also in {self.files[name].path}")
                self.files[name] = file

    def __getitem__(self, name: str) -> np.ndarray:
        return self.files[name].view(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def entry(self, name: str) -> TensorEntry:
        return self.files[name].entries[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entry(name).shape

    def dtype(self, name: str) -> np.dtype:
        """The tensor's checkpoint dtype as numpy sees it; ValueError naming the file if unsupported."""
        return self.files[name].numpy_dtype(name)

    def nbytes(self, names=None) -> int:
        entries = (self.entry(n) for n in (self if names is None else names))
        return sum(e.end - e.begin for e in entries)

    def largest_shard_bytes(self) -> int:
        return max((f.path.stat().st_size for f in self.shards), default=0)


def open_checkpoint(directory: str | Path) -> Checkpoint:
    """Read and validate the headers of every shard in `directory`; no tensor data is read."""
    return Checkpoint([SafetensorsFile(path) for path in safetensors_files(Path(directory))])


def safetensors_files(directory: Path) -> list[Path]:
    """The shard paths of an HF directory (see the module docstring)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise ValueError(f"{index}: malformed safetensors index ({type(exc).__name__}: {exc})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index}: 'weight_map' must map tensor names to shard file names")
        files = [directory / f for f in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index}: lists shards that do not exist: {', '.join(missing)}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if files:
        return files
    pickles = [p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
    if pickles:
        raise ValueError(f"{directory}: only pickle checkpoints found ({', '.join(pickles)}); they are never "
                         "read (arbitrary code execution). Convert the model to safetensors first.")
    raise FileNotFoundError(f"{directory}: no *.safetensors weights found")
