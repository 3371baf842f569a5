"""The shards a weight sync gave a group, kept on disk so that a rebuilt group comes back
with exactly those weights (``hybridflow.control.weights`` records which files, with their
digests, in the group's journal).

One directory per group, one subdirectory per sync (``v<version>-<sync id>``) and in it
one safetensors file per rank (``rank<r>.safetensors``), written whole to a temporary
name, flushed to disk and renamed before the sync is recorded. A file is read back whole
and checked against its recorded size and SHA-256 before any of it is used: a file that
is missing, cut short or changed is a :class:`ShardFileError`, never other weights. Its message names the file by its
place in the group's directory (``v<version>-<sync id>/rank<r>.safetensors``), never by
the server's absolute path.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

#: A sync's subdirectory and a rank's file in it: names the journal may hold, and nothing
#: that could reach outside the group's directory.
SYNC_DIR = re.compile(r"^v[0-9]{1,15}-[0-9a-f]{1,32}$")
RANK_FILE = re.compile(r"^rank[0-9]{1,6}\.safetensors$")


class ShardFileError(ValueError):
    """A kept shard file that cannot be used: missing, of another size or digest, or not
    the shards it should hold."""


@dataclass(frozen=True)
class ShardFile:
    """One rank's shards of one sync, as the journal records them."""

    rank: int
    sync_dir: str
    name: str
    sha256: str
    size: int

    def to_record(self) -> dict[str, Any]:
        return {"rank": self.rank, "sync_dir": self.sync_dir, "name": self.name, "sha256": self.sha256,
                "size": self.size}

    @classmethod
    def from_record(cls, record: Any) -> ShardFile:
        """A record read back from the journal, checked (ShardFileError when it is not one)."""
        keys = {"rank", "sync_dir", "name", "sha256", "size"}
        if not isinstance(record, dict) or set(record) != keys:
            raise ShardFileError(f"a shard file record has the fields {sorted(keys)}, got {record!r:.200}")
        rank, sync_dir, name, digest, size = (record[k] for k in ("rank", "sync_dir", "name", "sha256", "size"))
        if type(rank) is not int or rank < 0 or type(size) is not int or size < 1:
            raise ShardFileError(f"a shard file record needs a rank and a positive size, got {record!r:.200}")
        if not isinstance(sync_dir, str) or not SYNC_DIR.match(sync_dir):
            raise ShardFileError(f"not a sync directory's name: {sync_dir!r:.80}")
        if not isinstance(name, str) or not RANK_FILE.match(name):
            raise ShardFileError(f"not a rank file's name: {name!r:.80}")
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise ShardFileError(f"not a SHA-256 digest: {digest!r:.80}")
        return cls(rank, sync_dir, name, digest, size)


@dataclass(frozen=True)
class KeptSync:
    """A sync's files on disk: its directory, version and their bytes."""

    sync_dir: str
    version: int
    bytes: int


def version_of(sync_dir: str) -> int:
    """The version in a sync directory's name (``v<version>-<sync id>``)."""
    if not SYNC_DIR.match(sync_dir):
        raise ValueError(f"not a sync directory's name: {sync_dir!r}")
    return int(sync_dir[1:].split("-", 1)[0])


def _shown(file: ShardFile) -> str:
    """How a message names a file: its place in the group's directory."""
    return f"{file.sync_dir}/{file.name}"


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class GroupShardFiles:
    """The synced shards of one group, under ``directory``."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def new_sync(self, version: int, sync_id: str) -> str:
        """Make the subdirectory of a sync; its name."""
        name = f"v{version}-{sync_id[:32]}"
        if not SYNC_DIR.match(name):
            raise ValueError(f"not a sync directory's name: {name!r}")
        (self.directory / name).mkdir(parents=True, exist_ok=False)
        _fsync_directory(self.directory)
        return name

    def write(self, sync_dir: str, rank: int, shards: dict[str, torch.Tensor], version: int) -> ShardFile:
        """Write one rank's shards (CPU tensors by logical name) and flush them to disk."""
        data = save_safetensors(
            {name: tensor.contiguous() for name, tensor in shards.items()},
            metadata={"rank": str(rank), "weights_version": str(version)},
        )
        name = f"rank{rank}.safetensors"
        folder = self.directory / sync_dir
        partial = folder / f".{name}.partial"
        with open(partial, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, folder / name)
        _fsync_directory(folder)
        return ShardFile(rank, sync_dir, name, hashlib.sha256(data).hexdigest(), len(data))

    def missing(self, files: list[ShardFile]) -> list[str]:
        """The files of ``files`` that are not there with their recorded size."""
        gone = []
        for file in files:
            try:
                size = (self.directory / file.sync_dir / file.name).stat().st_size
            except FileNotFoundError:
                gone.append(f"{_shown(file)} is missing")
                continue
            if size != file.size:
                gone.append(f"{_shown(file)} has {size} bytes, {file.size} were written")
        return gone

    def read(self, file: ShardFile) -> dict[str, torch.Tensor]:
        """One rank's shards, after checking the file's size and digest."""
        try:
            data = (self.directory / file.sync_dir / file.name).read_bytes()
        except OSError as exc:
            why = exc.strerror or type(exc).__name__
            raise ShardFileError(f"{_shown(file)} cannot be read ({type(exc).__name__}: {why})") from None
        if len(data) != file.size or hashlib.sha256(data).hexdigest() != file.sha256:
            raise ShardFileError(f"{_shown(file)} is not the file that was written (its size or SHA-256 differs)")
        try:
            return load_safetensors(data)
        except Exception as exc:  # a file that matches its digest but is not safetensors
            raise ShardFileError(f"{_shown(file)} is not a safetensors file ({type(exc).__name__})") from None

    def remove(self, sync_dir: str) -> None:
        if SYNC_DIR.match(sync_dir):
            shutil.rmtree(self.directory / sync_dir, ignore_errors=True)

    def kept(self) -> list[KeptSync]:
        """Every sync whose files are on disk, with their bytes, in the order they were
        written (their directory's time, then their version): the latest last. Not by
        version alone: a group whose stored state was discarded numbers from 1 again."""
        if not self.directory.is_dir():
            return []
        found = []
        for entry in self.directory.iterdir():
            if entry.is_dir() and SYNC_DIR.match(entry.name):
                size = sum(f.stat().st_size for f in entry.iterdir() if f.is_file() and RANK_FILE.match(f.name))
                found.append((entry.stat().st_mtime_ns, KeptSync(entry.name, version_of(entry.name), size)))
        return [kept for _, kept in sorted(found, key=lambda pair: (pair[0], pair[1].version, pair[1].sync_dir))]

    def keep_only(self, kept: set[str]) -> list[str]:
        """Remove every sync's subdirectory but ``kept``; the names removed."""
        if not self.directory.is_dir():
            return []
        removed = []
        for entry in sorted(self.directory.iterdir()):
            if entry.is_dir() and SYNC_DIR.match(entry.name) and entry.name not in kept:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
        return removed
