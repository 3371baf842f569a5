"""examples/weight_sync_gpu.py on CPU: its dry run (the collective path on gloo between
spawned source and destination processes, every received slice checked in the ranks) and
its single-GPU loopback measurement on CPU tensors, so the script a GPU node runs is
known to work end to end before it gets there."""

from __future__ import annotations

import json

import torch

from examples import weight_sync_gpu as script
from single_controller.weights.plan import plan_resharding


def test_dry_run_on_gloo(tmp_path, capsys):
    out = tmp_path / "report.json"
    argv = ["--device", "cpu", "--hidden", "16", "--ffn", "32", "--src-tp", "2", "--dst-tp", "1", "--rounds", "1"]
    assert script.main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["gpus"] == 0 and report["layer"] == "16x32 tp2->tp1"
    assert report["bytes_per_dst_rank"] == [report["full_model_bytes"]] == [3 * 16 * 32 * 4]
    assert report["collective"]["what"] == "gloo between 3 processes"
    assert report["collective"]["gbps"] > 0
    assert json.loads(capsys.readouterr().out) == report


def test_loopback_moves_every_slice():
    src, dst = script.layouts(8, 16, 4, 2, [""] * 4, [""] * 2, "cpu")
    measured = script.loopback(plan_resharding(src, dst), src, dst, 2, torch.device("cpu"))
    assert len(measured["round_seconds"]) == 2


def test_values_are_the_same_whoever_makes_them():
    full = script.values(((0, 6), (0, 4)), torch.device("cpu"))
    assert torch.equal(script.values(((2, 5), (1, 3)), torch.device("cpu")), full[2:5, 1:3])
