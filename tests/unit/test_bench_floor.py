"""The bench's floors: the cold-start floor starts the processes the shipped config's
groups start, by worker class (a pool's ranks, a merged pool's processes once, a plain
actor one, a colocated group none of its own)."""

from __future__ import annotations

import yaml

from bench.http_figures import rank_processes
from tests.serve_process import CONFIG


def test_the_cold_start_floor_starts_the_shipped_configs_processes():
    args = yaml.safe_load(CONFIG.read_text())["applications"][0]["args"]
    counts = rank_processes(args)
    tutorial = "single_controller.models.tutorial_workers"
    assert counts[f"{tutorial}:Accumulator"] == 1
    assert counts[f"{tutorial}:GPUAccumulator"] == 4 + 4 + 8  # gpu_accumulator, _a, and the merge
    assert f"{tutorial}:GPUAccumulatorDecorator" not in counts  # on the merge's processes
    assert counts["examples.transport_check:TransportCheckActor"] == 4
    assert counts["single_controller.models.mlp_worker:MLPLayerWorker"] == 4 + 2  # mlp, and mlp_rollout


def test_a_megatron_rank_of_the_floor_imports_what_the_service_rank_imports():
    import importlib

    from bench.floor_app import MEGATRON_RANK_IMPORTS, import_class, rank_imports

    assert rank_imports(import_class("single_controller.models.mlp_worker:MLPLayerWorker")) == MEGATRON_RANK_IMPORTS
    assert rank_imports(import_class("single_controller.models.tutorial_workers:GPUAccumulator")) == ()
    assert rank_imports(import_class("examples.transport_check:TransportCheckActor")) == ()
    for module in MEGATRON_RANK_IMPORTS:  # real modules: the floor's rank would fail to start
        importlib.import_module(module)
