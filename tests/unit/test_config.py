"""The serve config: the default file validates and derives the tutorial's placement, and
every kind of bad config fails with a message naming its path. No Ray."""

from __future__ import annotations

import copy
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from hybridflow.config import ConfigError, colocations, load_config
from hybridflow.control.placement import GpuBudget, plan_deployment

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ARGS = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]


def args_with(*groups: dict, models: list | None = None, **top) -> dict:
    return {**top, "deployments": [{"name": "d", "groups": list(groups), "models": models or []}]}


COUNTER = {"name": "counter", "worker": "single_controller.models.tutorial_workers:GPUAccumulator",
           "pool": {"process_on_nodes": [2]}}


def problems(args: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(args)
    return str(caught.value)


def test_the_default_config_declares_the_tutorial():
    config = load_config(DEFAULT_ARGS)
    assert [d.name for d in config.deployments] == ["accumulators", "test_actor", "mlp"]
    assert config.deployment_of_group() == {
        "accumulator": "accumulators", "gpu_accumulator": "accumulators", "gpu_accumulator_a": "accumulators",
        "gpu_accumulator_merge": "accumulators", "gpu_accumulator_decorator": "accumulators",
        "test_actor": "test_actor", "mlp": "mlp", "mlp_rollout": "mlp",
    }
    assert sorted(m.name for _, m in config.models()) == ["checksum", "echo", "mlp", "mlp_rollout"]


def test_bundles_and_offsets_are_derived_from_the_declaration():
    config = load_config(DEFAULT_ARGS)
    budget = GpuBudget(0)
    accumulators = plan_deployment(config.deployments[0], config, budget)
    # the replica's bundle, then pool [4] at 1..4 and pool 'a' [4] at 5..8; the merge adds none
    assert len(accumulators.replica_bundles()) == 9
    assert accumulators.pools["gpu_accumulator"].first_bundle == 1
    assert accumulators.pools["gpu_accumulator_a"].first_bundle == 5
    assert accumulators.group_pools["gpu_accumulator_merge"] == ("gpu_accumulator", "gpu_accumulator_a")
    assert accumulators.group_pools["gpu_accumulator_decorator"] == ("gpu_accumulator", "gpu_accumulator_a")
    assert accumulators.colocations == [["gpu_accumulator_merge", "gpu_accumulator_decorator"]]
    assert accumulators.group_pools["accumulator"] == ()
    options = accumulators.serve_options()
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert options["placement_group_bundles"][0] == {"CPU": config.replica_cpus}
    assert all(b == {"CPU": config.worker_cpus} for b in options["placement_group_bundles"][1:])


def test_use_gpu_auto_takes_gpus_per_deployment_while_they_last():
    config = load_config(DEFAULT_ARGS)
    budget = GpuBudget(9)  # the accumulators' 8, then not enough for test_actor's 4
    plans = [plan_deployment(d, config, budget) for d in config.deployments]
    assert [p.gpus for p in plans] == [8, 0, 0]
    assert plans[0].replica_bundles()[1] == {"CPU": config.worker_cpus, "GPU": 1.0}
    budget = GpuBudget(18)
    assert [plan_deployment(d, config, budget).gpus for d in config.deployments] == [8, 4, 6]


def test_a_pool_over_several_nodes_gets_placement_groups_of_its_own():
    spread = {**COUNTER, "name": "spread", "pool": {"process_on_nodes": [2, 2]}}
    config = load_config(args_with(COUNTER, spread))
    plan = plan_deployment(config.deployments[0], config, GpuBudget(0))
    assert plan.pools["counter"].first_bundle == 1
    assert plan.pools["spread"].first_bundle is None
    assert len(plan.replica_bundles()) == 1 + 2


def test_merging_a_gpu_and_a_cpu_pool_is_refused():
    gpu = {**COUNTER, "name": "gpu", "pool": {"process_on_nodes": [2], "use_gpu": True}}
    cpu = {**COUNTER, "name": "cpu", "pool": {"process_on_nodes": [2], "use_gpu": False}}
    both = {**COUNTER, "name": "both", "pool": {"merge": ["gpu", "cpu"]}}
    config = load_config(args_with(gpu, cpu, both))
    with pytest.raises(ValueError, match=r"groups\[both\].pool.merge: cannot merge GPU and CPU pools"):
        plan_deployment(config.deployments[0], config, GpuBudget(8))


def test_colocations_are_symmetric_and_transitive():
    a = {**COUNTER, "name": "a", "colocate_with": ["b"]}
    b = {**COUNTER, "name": "b", "pool": {"same_as": "a"}}
    c = {**COUNTER, "name": "c", "pool": {"same_as": "b"}, "colocate_with": ["b"]}
    config = load_config(args_with(a, b, c))
    assert colocations(config.deployments[0]) == [["a", "b", "c"]]


BAD_CONFIGS = [
    ("no deployments", {}, "deployments: Field required"),
    ("unknown worker module", args_with({**COUNTER, "worker": "no_such_pkg.workers:Counter"}),
     "deployments[d].groups[counter].worker: cannot import 'no_such_pkg.workers:Counter': ModuleNotFoundError"),
    ("unknown worker class", args_with({**COUNTER, "worker": "single_controller.models.tutorial_workers:Nope"}),
     "groups[counter].worker: cannot import"),
    ("not module:Class", args_with({**COUNTER, "worker": "just_a_module"}), "must be 'module:Class'"),
    ("not a Worker", args_with({**COUNTER, "worker": "single_controller.models.tutorial_workers:Accumulator"}),
     "groups[counter].worker: Accumulator is not a Worker subclass"),
    ("not a class", args_with({**COUNTER, "worker": "hybridflow.config:load_config"}), "is a function, not a class"),
    ("same_as unknown", args_with(COUNTER, {**COUNTER, "name": "view", "pool": {"same_as": "nope"}}),
     "groups[view].pool.same_as: unknown group 'nope'"),
    ("merge unknown", args_with(COUNTER, {**COUNTER, "name": "m", "pool": {"merge": ["counter", "other"]}}),
     "groups[m].pool.merge: unknown group 'other'"),
    ("merge of one", args_with(COUNTER, {**COUNTER, "name": "m", "pool": {"merge": ["counter"]}}),
     "merge needs at least two groups"),
    ("two pool sources", args_with({**COUNTER, "pool": {"process_on_nodes": [2], "same_as": "x"}}),
     "give exactly one of process_on_nodes, same_as, merge"),
    ("pool cycle", args_with({**COUNTER, "name": "a", "pool": {"same_as": "b"}},
                             {**COUNTER, "name": "b", "pool": {"same_as": "a"}}), "cycle"),
    ("duplicate group", args_with(COUNTER, COUNTER), "duplicate group name 'counter'"),
    ("duplicate across deployments",
     {"deployments": [{"name": "d1", "groups": [COUNTER]}, {"name": "d2", "groups": [COUNTER]}]},
     "duplicate group name 'counter'"),
    ("duplicate deployment", {"deployments": [{"name": "d", "groups": [COUNTER]},
                                              {"name": "d", "groups": [{**COUNTER, "name": "x"}]}]},
     "duplicate deployment name 'd'"),
    ("reserved deployment", {"deployments": [{"name": "ingress", "groups": [COUNTER]}]},
     "'ingress' is the application's own deployment"),
    ("no pool", args_with({"name": "g", "worker": COUNTER["worker"]}), "groups[g]: Value error, needs a pool"),
    ("bad process count", args_with({**COUNTER, "pool": {"process_on_nodes": [0]}}),
     "groups[counter].pool.process_on_nodes"),
    ("unknown field", args_with({**COUNTER, "replicas": 3}), "groups[counter].replicas: Extra inputs are not permitted"),
    ("model of unknown group", args_with(COUNTER, models=[{
        "name": "m", "group": "nope", "method": "add",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}]}]),
     "deployments[d].models[m].group: unknown group 'nope'"),
    ("model of unknown method", args_with(COUNTER, models=[{
        "name": "m", "group": "counter", "method": "nope",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}]}]),
     "deployments[d].models[m].method: GPUAccumulator has no method 'nope'"),
    ("model datatype", args_with(COUNTER, models=[{
        "name": "m", "group": "counter", "method": "add",
        "inputs": [{"name": "x", "datatype": "STRING", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}]}]), "models[m].inputs[x].datatype"),
    ("read_only typo", args_with({**COUNTER, "read_only": ["get_valeu"]}),
     "groups[counter].read_only: GPUAccumulator has no method 'get_valeu'"),
    ("init call typo", args_with({**COUNTER, "init_calls": [{"method": "nope"}]}),
     "groups[counter].init_calls: GPUAccumulator has no method 'nope'"),
    ("colocation across pools", args_with(COUNTER, {**COUNTER, "name": "other", "colocate_with": ["counter"]}),
     "colocated groups must share one pool"),
    ("colocate unknown", args_with({**COUNTER, "colocate_with": ["ghost"]}), "colocate_with: unknown group 'ghost'"),
    ("megatron worker", args_with({**COUNTER, "megatron": {"tensor_model_parallel_size": 2}}),
     "a megatron group needs a MegatronWorker subclass"),
    ("plain actor with a pool", args_with({**COUNTER, "plain_actor": True}), "a plain_actor group has no pool"),
    ("bad group name", args_with({**COUNTER, "name": "has space"}), "groups[has space].name"),
]


@pytest.mark.parametrize("args, expected", [case[1:] for case in BAD_CONFIGS], ids=[case[0] for case in BAD_CONFIGS])
def test_bad_configs_name_their_path(args, expected):
    assert expected in problems(copy.deepcopy(args))


def test_every_problem_is_listed_at_once():
    message = problems(args_with(
        {**COUNTER, "name": "a", "worker": "no_such:X"},
        {**COUNTER, "name": "b", "pool": {"same_as": "ghost"}},
    ))
    assert "groups[b].pool.same_as" in message


def test_a_worker_module_outside_the_project(tmp_path, monkeypatch):
    package = tmp_path / "my_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "workers.py").write_text(textwrap.dedent("""
        from single_controller.base import Worker

        class Counter(Worker):
            def __init__(self, start=0):
                super().__init__()
                self.value = start

            def add(self, x):
                self.value += x
                return self.value

            def get(self):
                return self.value
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(args_with({"name": "counter", "worker": "my_pkg.workers:Counter", "init_kwargs": {"start": 5},
                                    "pool": {"process_on_nodes": [2], "use_gpu": "auto", "name_prefix": "c"},
                                    "read_only": ["get"]}))
    assert config.deployments[0].groups[0].init_kwargs == {"start": 5}
    sys.modules.pop("my_pkg.workers", None)
    sys.modules.pop("my_pkg", None)


def test_auth_token_from_the_environment(monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_TOKEN", "t0ken")
    assert load_config(DEFAULT_ARGS).auth_token == "t0ken"


def test_controllers_in_the_ingress_take_every_pool_bundle_in_one_placement_group():
    from hybridflow.control.placement import hosted_bundles

    config = load_config({**DEFAULT_ARGS, "controllers_in_ingress": True})
    budget = GpuBudget(0)
    plans = [plan_deployment(d, config, budget) for d in config.deployments]
    bundles, shifts = hosted_bundles(plans, config.ingress_cpus)
    # the ingress's own bundle, then accumulators' 8, test_actor's 4, mlp's 4 and mlp_rollout's 2
    assert len(bundles) == 1 + 8 + 4 + 6 and bundles[0] == {"CPU": config.ingress_cpus}
    assert shifts == [0, 8, 12]
    # each pool's first bundle, shifted, lands on that deployment's own bundles
    firsts = {name: pool.first_bundle + shift for plan, shift in zip(plans, shifts, strict=True)
              for name, pool in plan.pools.items()}
    assert firsts == {"gpu_accumulator": 1, "gpu_accumulator_a": 5, "test_actor": 9, "mlp": 13, "mlp_rollout": 17}
    assert "ingress_replicas 1" in problems({**DEFAULT_ARGS, "controllers_in_ingress": True, "ingress_replicas": 2})


@pytest.mark.parametrize(("setting", "replicas", "embedded"), [
    ("auto", 1, True), ("auto", 2, False), (True, 1, True), (False, 1, False), (False, 3, False),
])
def test_controllers_in_ingress_auto_embeds_while_the_ingress_has_one_replica(setting, replicas, embedded):
    config = load_config({**DEFAULT_ARGS, "controllers_in_ingress": setting, "ingress_replicas": replicas})
    assert config.controllers_embedded is embedded


def test_the_shipped_config_embeds_the_controllers():
    shipped = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]
    config = load_config(shipped)
    assert config.controllers_in_ingress == "auto" and config.controllers_embedded
    assert "controllers_in_ingress" in problems({**DEFAULT_ARGS, "controllers_in_ingress": "sometimes"})
