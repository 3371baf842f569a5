"""Pools over two nodes of Ray's multi-node test cluster (see tests/multinode_check.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.own_cluster


@pytest.fixture(scope="module")
def seen() -> dict:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_DEDUP_LOGS": "0"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "multinode_check.py")],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_pool_of_two_nodes_numbers_ranks_node_by_node(seen):
    assert seen["nodes"] == 2 and seen["world_size"] == 4
    assert seen["ranks"] == [0, 1, 2, 3]
    nodes = seen["nodes_by_rank"]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]
    assert seen["local_ranks"] == [0, 1, 0, 1] == seen["pool_local_rank_list"]
    assert seen["local_world_sizes"] == [2, 2, 2, 2] == seen["pool_local_world_size_list"]
    # logical GPUs: each node's two ranks see that node's two devices
    assert seen["cuda_visible_devices"][0] != seen["cuda_visible_devices"][1]
    assert seen["add"] == [1.0, 2.0, 3.0, 4.0]


def test_entries_of_a_pool_go_to_distinct_nodes_even_when_one_node_could_hold_all(seen):
    nodes = seen["uneven_nodes_by_rank"]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]


def test_merged_pool_spans_both_nodes(seen):
    assert seen["merged_local_ranks"] == [0, 0]
    assert seen["merged_nodes"][0] != seen["merged_nodes"][1]


def test_tensor_parallel_groups_stay_inside_a_node(seen):
    assert seen["megatron_sizes"] == [2, 2, 1]
    infos, nodes = seen["megatron"], seen["nodes_by_rank"]
    for dp in (0, 1):
        members = [r for r, info in enumerate(infos) if info["dp_rank"] == dp]
        assert sorted(infos[r]["tp_rank"] for r in members) == [0, 1]
        assert len({nodes[r] for r in members}) == 1
    assert seen["megatron_rel_err"] <= 1e-5


def test_pool_larger_than_a_node_fails_fast(seen):
    message = seen["oversized_pool"]
    assert "process_on_nodes=[3, 3]" in message and "3 bundles on one node" in message
