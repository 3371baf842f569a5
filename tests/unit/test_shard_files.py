"""The files a weight sync's shards are kept in (hybridflow.state.shard_files): read back
exactly as written; a file missing, cut short or changed is refused, never read as other
weights; journal records that would name a path outside the group's directory are refused;
the kept syncs are listed with their bytes; only the syncs asked for are kept."""

from __future__ import annotations

import os

import pytest
import torch

from hybridflow.state.shard_files import GroupShardFiles, ShardFile, ShardFileError, version_of


def shards(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(8, 4, generator=g)
    return {"gate_proj": full[:4], "up_proj": full[4:], "down_proj": torch.randn(4, 4, generator=g).to(torch.bfloat16)}


def test_shards_read_back_as_written_and_the_record_round_trips(tmp_path):
    files = GroupShardFiles(tmp_path / "mlp" / "rollout")
    sync_dir = files.new_sync(3, "ab12" * 8)
    written = [files.write(sync_dir, rank, shards(rank), 3) for rank in range(2)]
    assert sync_dir == "v3-" + "ab12" * 8 and [f.name for f in written] == ["rank0.safetensors", "rank1.safetensors"]
    assert not list((tmp_path / "mlp" / "rollout" / sync_dir).glob(".*"))  # no partial file left
    for rank, file in enumerate(written):
        again = ShardFile.from_record(file.to_record())
        assert again == file
        back = files.read(again)
        for name, tensor in shards(rank).items():
            assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor)
    assert files.missing(written) == []


def test_a_changed_short_or_missing_file_is_refused(tmp_path):
    files = GroupShardFiles(tmp_path)
    sync_dir = files.new_sync(1, "00ff")
    file = files.write(sync_dir, 0, shards(0), 1)
    path = tmp_path / sync_dir / file.name
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ShardFileError, match="not the file that was written") as changed:
        files.read(file)
    path.write_bytes(bytes(data[:-1]))
    # named by their place in the group's directory, never by the server's absolute path
    shown = f"{sync_dir}/rank0.safetensors"
    assert files.missing([file]) == [f"{shown} has {file.size - 1} bytes, {file.size} were written"]
    path.unlink()
    assert files.missing([file]) == [f"{shown} is missing"]
    with pytest.raises(ShardFileError, match="cannot be read") as unreadable:
        files.read(file)
    for message in (str(changed.value), str(unreadable.value)):
        assert message.startswith(shown) and str(tmp_path) not in message, message
    assert str(unreadable.value) == f"{shown} cannot be read (FileNotFoundError: No such file or directory)"


@pytest.mark.parametrize("change", [
    {"sync_dir": "../../etc"}, {"name": "../rank0.safetensors"}, {"name": "rank0.pt"}, {"sha256": "x" * 64},
    {"rank": -1}, {"size": 0}, {"rank": True},
])
def test_records_that_are_not_a_shard_files_are_refused(tmp_path, change):
    record = {"rank": 0, "sync_dir": "v1-00ff", "name": "rank0.safetensors", "sha256": "0" * 64, "size": 10}
    with pytest.raises(ShardFileError):
        ShardFile.from_record({**record, **change})
    with pytest.raises(ShardFileError):
        ShardFile.from_record({**record, "extra": 1})


def test_the_kept_syncs_are_listed_in_the_order_written_with_their_bytes(tmp_path):
    files = GroupShardFiles(tmp_path)
    assert files.kept() == []  # nothing written yet
    written = {}
    for age, version in enumerate((10, 2, 3)):  # 10 before a reset, then 2 and 3
        sync_dir = files.new_sync(version, f"{version:04x}")
        written[version] = sum(files.write(sync_dir, rank, shards(rank), version).size for rank in range(2))
        os.utime(tmp_path / sync_dir, ns=(0, (1_000 + age) * 10**9))
    (tmp_path / "unrelated").mkdir()
    partial = tmp_path / "v3-0003" / ".rank1.safetensors.partial"
    partial.write_bytes(b"x" * 7)  # a write cut short: not a kept file
    os.utime(tmp_path / "v3-0003", ns=(0, 1_002 * 10**9))
    kept = files.kept()
    assert [(k.sync_dir, k.version) for k in kept] == [("v10-000a", 10), ("v2-0002", 2), ("v3-0003", 3)]
    assert [k.bytes for k in kept] == [written[10], written[2], written[3]]
    expected = sum(p.stat().st_size for p in tmp_path.rglob("rank*.safetensors"))
    assert sum(k.bytes for k in kept) == expected and all(k.bytes > 0 for k in kept)
    assert version_of("v10-000a") == 10
    with pytest.raises(ValueError):
        version_of("../v1-00")


def test_keep_only_removes_every_other_sync(tmp_path):
    files = GroupShardFiles(tmp_path)
    assert files.keep_only(set()) == []  # nothing written yet
    names = [files.new_sync(v, f"{v:04x}") for v in (1, 2, 3)]
    (tmp_path / "unrelated").mkdir()
    assert files.keep_only({names[1]}) == [names[0], names[2]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unrelated", names[1]]
    files.remove(names[1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unrelated"]
