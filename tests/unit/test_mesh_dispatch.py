"""Named meshes without Ray: a worker's declarations, a mesh across a group and its
checks, dispatch and collect by a mesh as pure functions, and the whole call flow on an
in-process group (the ``_query_*`` methods bound, each mesh asked once and kept)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from single_controller import DataProto
from single_controller.base import Worker
from single_controller.base.decorator import (
    PADDING_KEY,
    Dispatch,
    DispatchError,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)
from single_controller.base.dispatch_registry import dispatch_mode_name, resolve_dispatch_mode
from single_controller.base.mesh import MeshError, MeshLayout, MeshPlaces
from single_controller.base.mesh_dispatch import collect_nd_compute_proto, dispatch_nd_compute_proto
from single_controller.base.worker_group import WorkerGroup
from single_controller.base.worker_methods import public_methods, registered_methods


def rows(n: int) -> TensorDict:
    return TensorDict({"x": torch.arange(float(n))}, batch_size=[n])


# -- a worker's declarations ------------------------------------------------------------


def test_a_worker_declares_each_mesh_once():
    places = MeshPlaces()
    places.register("infer", 1, True)
    assert (places.dp_rank("infer"), places.is_collect("infer")) == (1, True)
    with pytest.raises(MeshError, match="'infer' is already registered"):
        places.register("infer", 0, False)
    with pytest.raises(MeshError, match="'train' is not registered on this worker; registered: \\['infer'\\]"):
        places.dp_rank("train")
    assert places.snapshot() == {"dispatch_dp_rank": {"infer": 1}, "collect_dp_rank": {"infer": True}}


@pytest.mark.parametrize(
    "mesh, dp_rank, is_collect, message",
    [("", 0, True, "non-empty string"), ("m", -1, True, "non-negative integer"), ("m", True, True, "integer"),
     ("m", 0, 1, "is_collect is a bool")],
)
def test_bad_declarations_are_value_errors(mesh, dp_rank, is_collect, message):
    with pytest.raises(ValueError, match=message):
        MeshPlaces().register(mesh, dp_rank, is_collect)


def test_numpy_and_torch_booleans_count_as_bools():
    places = MeshPlaces()
    places.register("a", torch.tensor(3).item(), torch.tensor(2) == 2)
    assert places.places() == {"a": (3, True)}


def test_a_fused_worker_takes_its_roles_places():
    """What verl's fused ActorRolloutRef worker does: each role's place under a mesh name
    of the fused worker; a name taken twice is refused (an AssertionError too, as verl)."""
    ref, actor, fused = MeshPlaces(), MeshPlaces(), MeshPlaces()
    ref.register("actor", 0, True)
    actor.register("actor", 1, False)
    fused.adopt("ref", **ref.snapshot())
    fused.adopt("actor", **actor.snapshot())
    assert fused.places() == {"ref": (0, True), "actor": (1, False)}
    with pytest.raises(AssertionError, match="'actor' is already registered"):
        fused.adopt("actor", **actor.snapshot())
    both = MeshPlaces()
    both.register("x", 0, True)
    both.register("y", 1, False)
    fused.adopt("y", **both.snapshot())  # the entry named like the target
    assert fused.places()["y"] == (1, False)
    with pytest.raises(MeshError, match="ambiguous|give it one mesh"):
        MeshPlaces().adopt("z", **both.snapshot())


def test_worker_methods_read_and_write_the_places(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "12345")
    worker = Worker()
    worker._register_dispatch_collect_info(mesh_name="actor", dp_rank=2, is_collect=False)
    assert (worker._query_dispatch_info("actor"), worker._query_collect_info("actor")) == (2, False)
    assert worker.query_collect_info("actor") is False
    assert worker._query_meshes() == {"actor": (2, False)}
    other = Worker()
    other.set_dispatch_collect("critic", **worker.get_dispatch_collect())
    assert other.get_dispatch_collect() == {"dispatch_dp_rank": {"critic": 2}, "collect_dp_rank": {"critic": False}}


# -- a mesh across a group --------------------------------------------------------------


def test_a_mesh_lists_each_dp_ranks_collecting_rank_in_dp_order():
    mesh = MeshLayout.of("train", [1, 1, 0, 0], [False, True, False, True])
    assert (mesh.dp_size, mesh.world_size, mesh.collect_ranks) == (2, 4, [3, 1])
    assert mesh.describe() == {"dp_size": 2, "dp_ranks": [1, 1, 0, 0], "collect_ranks": [3, 1]}


@pytest.mark.parametrize(
    "dp_ranks, collect, message",
    [
        ([0, 2], [True, True], r"dp ranks \[1\] have no rank"),
        ([0, 0, 1, 1], [True, True, True, False], r"exactly one collecting rank; dp rank 0: ranks \[0, 1\]"),
        ([0, 0, 1, 1], [True, False, False, False], r"dp rank 1: ranks \[\]"),
        ([0, 1], [True], "2 dp ranks but 1 collect flags"),
        ([], [], "has no ranks"),
    ],
)
def test_a_mesh_that_would_lose_or_repeat_rows_is_refused(dp_ranks, collect, message):
    with pytest.raises(MeshError, match=message):
        MeshLayout.of("m", dp_ranks, collect)


# -- dispatch and collect by a mesh -----------------------------------------------------

INFER = MeshLayout.of("infer", [0, 0, 1, 1], [True, False, True, False])


def test_ranks_of_one_dp_rank_get_the_same_part():
    args, kwargs = dispatch_nd_compute_proto(INFER, rows(4), other=rows(4))
    (parts,) = args
    assert [p["x"].tolist() for p in parts] == [[0.0, 1.0], [0.0, 1.0], [2.0, 3.0], [2.0, 3.0]]
    assert parts[0] is parts[1] and parts[2] is parts[3]  # one object each: put once for its ranks
    assert kwargs["other"][3]["x"].tolist() == [2.0, 3.0]
    assert PADDING_KEY not in kwargs


def test_a_tensordict_that_does_not_divide_is_padded_and_a_dataproto_refused(no_global_padding):
    args, kwargs = dispatch_nd_compute_proto(INFER, rows(3))
    assert kwargs[PADDING_KEY] == 1 and args[0][2]["x"].tolist() == [2.0, 0.0]
    with pytest.raises(DispatchError, match=r"ND_COMPUTE_PROTO\(infer\): positional argument 0 has 3 rows"):
        dispatch_nd_compute_proto(INFER, DataProto.from_dict({"x": torch.arange(3.0)}))
    with pytest.raises(DispatchError, match="expects a DataProto or TensorDict batch"):
        dispatch_nd_compute_proto(INFER, [1, 2])


def test_collect_takes_the_collecting_ranks_in_dp_order():
    train = MeshLayout.of("train", [1, 1, 0, 0], [False, True, False, True])
    outputs = [rows(2).apply(lambda t, r=r: t + 10 * r) for r in range(4)]
    assert collect_nd_compute_proto(train, outputs)["x"].tolist() == [30.0, 31.0, 10.0, 11.0]
    assert collect_nd_compute_proto(train, ["a", "b", "c", "d"]) == ["d", "b"]  # not batches: a list by dp
    with pytest.raises(DispatchError, match="expected 4 outputs, got 3"):
        collect_nd_compute_proto(train, ["a", "b", "c"])


def test_jagged_rows_go_through_split_and_back():
    ids = torch.nested.as_nested_tensor([torch.arange(n) for n in (1, 4, 2, 3, 5, 2)], layout=torch.jagged)
    pos = torch.nested.as_nested_tensor([torch.arange(n).expand(3, n) for n in (2, 3, 4, 5, 6, 7)],
                                        layout=torch.jagged)
    batch = TensorDict({"ids": ids, "pos": pos, "x": torch.arange(6.0)}, batch_size=[6])
    (parts,), _ = dispatch_nd_compute_proto(INFER, batch)
    assert [len(t) for t in parts[2]["ids"].unbind(0)] == [3, 5, 2]
    assert [tuple(t.shape) for t in parts[0]["pos"].unbind(0)] == [(3, 2), (3, 3), (3, 4)]
    sent = pickle.loads(pickle.dumps(parts[2]))  # what a rank receives carries only its rows
    assert sent["pos"].unbind(0)[2].equal(torch.arange(7).expand(3, 7))
    back = collect_nd_compute_proto(INFER, parts)
    assert back["ids"].values().tolist() == ids.values().tolist()
    assert [tuple(t.shape) for t in back["pos"].unbind(0)] == [tuple(t.shape) for t in pos.unbind(0)]


def test_the_mode_is_a_named_picklable_spec():
    spec = make_nd_compute_dataproto_dispatch_fn("train")
    assert set(spec) == {"dispatch_fn", "collect_fn"}  # reads as verl's dict
    assert resolve_dispatch_mode(spec) is spec and dispatch_mode_name(spec) == "ND_COMPUTE_PROTO(train)"
    again = pickle.loads(pickle.dumps(spec))
    assert again.mesh_name == "train" and again.collect_needs_values
    with pytest.raises(ValueError, match="non-empty string"):
        make_nd_compute_dataproto_dispatch_fn("")


# -- the catalogue's view and the call flow ---------------------------------------------


class MeshWorker(Worker):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self._rank = rank
        self._register_dispatch_collect_info("infer", dp_rank=rank // 2, is_collect=rank % 2 == 0)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("infer"))
    def tag(self, batch: TensorDict) -> TensorDict:
        return TensorDict({"x": batch["x"], "rank": torch.full((len(batch),), self.rank)}, batch_size=[len(batch)])

    @register(Dispatch.ONE_TO_ALL)
    def ping(self) -> int:
        return self.rank


def test_mesh_methods_are_public_and_the_queries_are_not():
    names = public_methods(MeshWorker)
    assert names == ["ping", "tag"]
    specs = registered_methods(MeshWorker)
    assert specs["tag"].dispatch_name == "ND_COMPUTE_PROTO(infer)"
    assert {"_query_dispatch_info", "_query_collect_info", "_query_meshes"} <= set(specs)


class LocalGroup(WorkerGroup):
    """A group whose ranks are objects in this process (calls answer at once)."""

    def __init__(self, workers: list[Any]) -> None:
        super().__init__(resource_pool=None)
        self._workers = workers
        self.calls: list[str] = []
        self._bind_worker_method(type(workers[0]))

    def _submit(self, rank: int, method: str, args: tuple, kwargs: dict) -> Any:
        self.calls.append(method)
        return getattr(self._workers[rank], method)(*args, **kwargs)

    def _wait(self, futures: Any) -> Any:
        return futures


@pytest.fixture
def local_group(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "12345")
    return LocalGroup([MeshWorker(rank) for rank in range(4)])


def test_a_group_asks_its_ranks_once_per_mesh(local_group):
    out = local_group.tag(rows(3))  # padded to 4, the padding dropped from the answer
    assert out["x"].tolist() == [0.0, 1.0, 2.0] and out["rank"].tolist() == [0, 0, 2]
    assert local_group._dispatch_info == {"infer": [0, 0, 1, 1]}
    assert local_group._collect_info == {"infer": [True, False, True, False]}
    asked = local_group.calls.count("_query_dispatch_info")
    local_group.tag(rows(4))
    assert local_group.calls.count("_query_dispatch_info") == asked == 4  # once per rank, then kept
    assert local_group._query_dispatch_info("infer") == [0, 0, 1, 1]  # bound on the group, as in verl


def test_meshes_lists_every_declared_mesh_and_refuses_a_partial_one(local_group):
    assert {name: m.describe() for name, m in local_group.meshes().items()} == {
        "infer": {"dp_size": 2, "dp_ranks": [0, 0, 1, 1], "collect_ranks": [0, 2]}
    }
    local_group.workers[3]._register_dispatch_collect_info("extra", 0, True)
    assert set(local_group.meshes(cached=True)) == {"infer"}  # no call to the ranks
    with pytest.raises(MeshError, match=r"'extra' is declared on some ranks but not on ranks \[0, 1, 2\]"):
        local_group.meshes()


def test_an_undeclared_mesh_fails_the_call_naming_the_method(local_group):
    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("nowhere"))
    def lost(self, batch):
        return batch

    local_group._method_specs["lost"] = registered_methods(type("W", (Worker,), {"lost": lost}))["lost"]
    with pytest.raises(DispatchError, match=r"lost: .*'nowhere' is not registered on this worker"):
        local_group.lost(rows(4))
