"""verl v0.4's dispatch registry on the one dispatch table, and the PROTO modes with
DataProto batches, as pure functions (no Ray)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

import single_controller.base.decorator as decorator_module
from single_controller import DataProto
from single_controller.base.decorator import (
    DISPATCH_MODE_FN_REGISTRY,
    DISPATCH_TABLE,
    PADDING_KEY,
    Dispatch,
    DispatchError,
    Execute,
    _check_dispatch_mode,
    collect_all_to_all,
    get_predefined_dispatch_fn,
    get_predefined_execute_fn,
    register,
    register_dispatch_mode,
    update_dispatch_mode,
)
from single_controller.base.dispatch_registry import resolve_dispatch_mode
from single_controller.base.worker_group import Collector, unpad_output
from single_controller.protocol import DataProtoConfig, _padding_size_key


class Flat:
    """A group of ``world_size`` ranks with no Megatron layout."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size


def dispatch(mode, group, *args, **kwargs):
    return resolve_dispatch_mode(mode).dispatch_fn(group, *args, **kwargs)


@pytest.fixture
def restore_registry():
    saved = DISPATCH_MODE_FN_REGISTRY.copy()
    yield
    decorator_module.DISPATCH_MODE_FN_REGISTRY.clear()
    decorator_module.DISPATCH_MODE_FN_REGISTRY.update(saved)



def rows(n: int, auto_padding: bool = False) -> DataProto:
    return DataProto.from_dict(
        {"x": torch.arange(float(n))}, {"id": [f"s{i}" for i in range(n)]}, meta_info={"m": 1}, auto_padding=auto_padding
    )


def test_the_registry_is_the_dispatch_table_and_entries_read_as_verls_dicts():
    assert DISPATCH_MODE_FN_REGISTRY is DISPATCH_TABLE
    entry = get_predefined_dispatch_fn(Dispatch.ONE_TO_ALL)
    assert set(entry) == {"dispatch_fn", "collect_fn"}
    assert entry == {"dispatch_fn": entry["dispatch_fn"], "collect_fn": collect_all_to_all}
    for name in ("DP_COMPUTE_PROTO_WITH_FUNC", "DP_COMPUTE_METRIC", "DIRECT_ROLLOUT_METHOD"):
        assert Dispatch[name] in DISPATCH_MODE_FN_REGISTRY
    assert get_predefined_execute_fn(Execute.RANK_ZERO) == {"execute_fn_name": "execute_rank_zero"}


def test_register_then_remove_a_mode(restore_registry):
    def first(group, *args, **kwargs):
        return tuple([a] * group.world_size for a in args), {}

    def last(group, outputs):
        return outputs[-1]

    register_dispatch_mode("TEST_REGISTRY_MODE", first, last)
    _check_dispatch_mode(Dispatch.TEST_REGISTRY_MODE)
    assert get_predefined_dispatch_fn(Dispatch.TEST_REGISTRY_MODE) == {"dispatch_fn": first, "collect_fn": last}
    assert dispatch(Dispatch.TEST_REGISTRY_MODE, Flat(3), "v") == ((["v", "v", "v"],), {})
    removed = Dispatch.remove("TEST_REGISTRY_MODE")
    assert removed.name == "TEST_REGISTRY_MODE" and "TEST_REGISTRY_MODE" not in Dispatch
    assert not hasattr(Dispatch, "TEST_REGISTRY_MODE")
    with pytest.raises(ValueError, match="not registered"):
        Dispatch.remove("TEST_REGISTRY_MODE")
    with pytest.raises(ValueError, match="not a registered Dispatch mode"):
        _check_dispatch_mode(removed)


def test_update_replaces_a_built_in_mode_until_the_registry_is_restored(restore_registry):
    original = get_predefined_dispatch_fn(Dispatch.ONE_TO_ALL)

    def pairs(group, *args, **kwargs):
        return tuple([(a, r) for r in range(group.world_size)] for a in args), {}

    update_dispatch_mode(Dispatch.ONE_TO_ALL, pairs, collect_all_to_all)
    assert get_predefined_dispatch_fn(Dispatch.ONE_TO_ALL)["dispatch_fn"] is pairs
    assert dispatch(Dispatch.ONE_TO_ALL, Flat(2), "a") == (([("a", 0), ("a", 1)],), {})
    # verl's tests save and restore the registry with plain dict operations
    DISPATCH_MODE_FN_REGISTRY.clear()
    DISPATCH_MODE_FN_REGISTRY.update({Dispatch.ONE_TO_ALL: dict(original)})
    assert dispatch(Dispatch.ONE_TO_ALL, Flat(2), "a") == ((["a", "a"],), {})


def test_registry_errors_are_value_errors():
    with pytest.raises(ValueError, match="must be a Dispatch mode"):
        update_dispatch_mode("ONE_TO_ALL", lambda g: g, lambda g, o: o)
    with pytest.raises(ValueError, match="must be a Dispatch mode or a dict"):
        _check_dispatch_mode(42)
    with pytest.raises(ValueError, match="missing"):
        _check_dispatch_mode({"dispatch_fn": print})
    with pytest.raises(ValueError, match="already registered"):
        register_dispatch_mode("ONE_TO_ALL", print, print)
    # verl's extra register keyword is accepted
    assert register(Dispatch.ONE_TO_ALL, materialize_futures=False)(lambda self: None)


def test_dp_compute_proto_splits_a_dataproto_and_collect_concatenates(no_global_padding):
    group = Flat(3)
    data = rows(6)
    (pieces,), kwargs = dispatch(Dispatch.DP_COMPUTE_PROTO, group, data)
    assert PADDING_KEY not in kwargs
    assert [p.non_tensor_batch["id"].tolist() for p in pieces] == [["s0", "s1"], ["s2", "s3"], ["s4", "s5"]]
    assert all(p.meta_info == {"m": 1} for p in pieces)
    merged = resolve_dispatch_mode(Dispatch.DP_COMPUTE_PROTO).collect_fn(group, pieces)
    assert isinstance(merged, DataProto) and merged.batch["x"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_a_dataproto_that_does_not_divide_needs_auto_padding(no_global_padding):
    group = Flat(4)
    with pytest.raises(DispatchError, match=r"has 6 rows, which do not split into 4 equal parts; .*auto_padding"):
        dispatch(Dispatch.DP_COMPUTE_PROTO, group, data=rows(6))
    data = rows(6, auto_padding=True)
    (pieces,), kwargs = dispatch(Dispatch.DP_COMPUTE_PROTO, group, data)
    assert kwargs[PADDING_KEY] == 2 and _padding_size_key == PADDING_KEY
    assert [len(p) for p in pieces] == [2, 2, 2, 2] and len(data) == 6  # the caller's batch is untouched
    out = Collector(resolve_dispatch_mode(Dispatch.DP_COMPUTE_PROTO).collect_fn, group, kwargs[PADDING_KEY])(pieces)
    assert out.non_tensor_batch["id"].tolist() == [f"s{i}" for i in range(6)]
    DataProtoConfig.auto_padding = True
    assert dispatch(Dispatch.MEGATRON_COMPUTE_PROTO, _tp2dp2(), rows(3))[1][PADDING_KEY] == 1


def _tp2dp2():
    from single_controller.ray.worker_group import GroupLayout, RankCoords

    return GroupLayout(
        world_size=4, rank_infos=[RankCoords(r % 2, r // 2, 0) for r in range(4)], tp_size=2, dp_size=2
    )


def test_with_func_sends_the_function_whole_and_splits_the_batches(no_global_padding):
    def measure(worker, batch):
        return batch

    args, kwargs = dispatch(Dispatch.DP_COMPUTE_PROTO_WITH_FUNC, Flat(2), measure, rows(4))
    assert args[0] == [measure, measure]
    assert [p.batch["x"].tolist() for p in args[1]] == [[0.0, 1.0], [2.0, 3.0]]
    with pytest.raises(DispatchError, match="function as its first positional argument"):
        dispatch(Dispatch.DP_COMPUTE_PROTO_WITH_FUNC, Flat(2), rows(4))
    with pytest.raises(DispatchError, match="positional argument 1"):
        dispatch(Dispatch.DP_COMPUTE_PROTO_WITH_FUNC, Flat(2), measure, [1, 2])


def test_metric_mode_splits_a_batch_and_keeps_one_answer_per_rank(no_global_padding):
    group = Flat(2)
    (pieces,), _ = dispatch(Dispatch.DP_COMPUTE_METRIC, group, rows(4))
    metrics = [{"loss": float(p.batch["x"].sum())} for p in pieces]
    assert resolve_dispatch_mode(Dispatch.DP_COMPUTE_METRIC).collect_fn(group, metrics) == [{"loss": 1.0}, {"loss": 5.0}]
    # padding never drops a rank's answer from a per-rank list
    assert unpad_output(metrics, 1) == metrics


def test_direct_rollout_methods_are_never_dispatched_by_a_group():
    with pytest.raises(DispatchError, match="rollout's own actors"):
        dispatch(Dispatch.DIRECT_ROLLOUT_METHOD, Flat(2))


def test_a_collector_travels_and_drops_the_padding():
    layout = _tp2dp2()
    collector = Collector(resolve_dispatch_mode(Dispatch.MEGATRON_COMPUTE_PROTO).collect_fn, layout, padding=1)
    restored = pickle.loads(pickle.dumps(collector))
    outputs = [rows(2), rows(2), rows(2)[[1, 0]], rows(2)[[1, 0]]]  # ranks 0,1 are dp 0; ranks 2,3 dp 1
    out = restored(outputs)
    assert out.batch["x"].tolist() == [0.0, 1.0, 1.0] and out.non_tensor_batch["id"].tolist() == ["s0", "s1", "s1"]
    assert np.array_equal(out.non_tensor_batch["id"], np.array(["s0", "s1", "s1"], dtype=object))
    single = Collector(collect_all_to_all, Flat(1), single=True)
    assert single(["only"]) == "only"
