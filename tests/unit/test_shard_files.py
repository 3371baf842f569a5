"""The files a weight sync's shards are kept in (hybridflow.state.shard_files): read back
exactly as written; a file missing, cut short or changed is refused, never read as other
weights; journal records that would name a path outside the group's directory are refused;
only the syncs a restore needs are kept."""

from __future__ import annotations

import pytest
import torch

from hybridflow.state.shard_files import GroupShardFiles, ShardFile, ShardFileError


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
    with pytest.raises(ShardFileError, match="not the file that was written"):
        files.read(file)
    path.write_bytes(bytes(data[:-1]))
    assert files.missing([file]) == [f"{path} has {file.size - 1} bytes, {file.size} were written"]
    path.unlink()
    assert files.missing([file]) == [f"{path} is missing"]
    with pytest.raises(ShardFileError, match="cannot be read"):
        files.read(file)


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


def test_keep_only_removes_every_other_sync(tmp_path):
    files = GroupShardFiles(tmp_path)
    assert files.keep_only(set()) == []  # nothing written yet
    names = [files.new_sync(v, f"{v:04x}") for v in (1, 2, 3)]
    (tmp_path / "unrelated").mkdir()
    assert files.keep_only({names[1]}) == [names[0], names[2]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unrelated", names[1]]
    files.remove(names[1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unrelated"]
