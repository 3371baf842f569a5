"""DataProto, the batch verl workers take and return: construction, row operations,
padding, key operations and pickling, as pure functions (no Ray)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from single_controller import DataProto
from single_controller.protocol import (
    DataProtoConfig,
    DataProtoError,
    DataProtoItem,
    fold_batch_dim,
    pad_dataproto_to_divisor,
    unfold_batch_dim,
    union_numpy_dict,
    union_tensor_dict,
    unpad_dataproto,
)
from tests.unit.fresh_interpreter import assert_fresh_python_prints_ok


def sample(rows: int = 6) -> DataProto:
    return DataProto.from_dict(
        tensors={"obs": torch.arange(rows * 2).reshape(rows, 2), "act": torch.arange(rows, dtype=torch.float32)},
        non_tensors={"label": [f"r{i}" for i in range(rows)]},
        meta_info={"step": 3},
    )


def test_importing_the_package_stays_cheap_and_serves_dataproto_lazily():
    code = (
        "import sys, single_controller; "
        "assert 'tensordict' not in sys.modules and 'ray' not in sys.modules and 'torch' not in sys.modules; "
        "from single_controller.base import Worker; from single_controller.base.decorator import Dispatch, register; "
        # a worker class needs no torch: the process of one that does not use it never loads it
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules, 'the worker base loaded torch or ray'; "
        "from single_controller import DataProto, DataProtoFuture, DataProtoConfig, Worker; "
        "from single_controller.protocol import DataProto as P; assert DataProto is P; "
        "from single_controller.base import Worker as W; assert Worker is W; print('ok')"
    )
    assert_fresh_python_prints_ok(code)


def test_the_ray_backend_loads_no_torch_so_a_colocated_worker_of_plain_classes_never_does():
    # A colocated (or fused) worker class is defined in single_controller.ray, so each of its
    # processes imports that package: torch there would cost every such process a second.
    code = (
        "import sys; import single_controller.ray, single_controller.ray.colocated, single_controller.ray.fused; "
        "from single_controller.ray import RayWorkerGroup, create_colocated_worker_cls; "
        "assert 'torch' not in sys.modules, 'single_controller.ray loaded torch'; print('ok')"
    )
    assert_fresh_python_prints_ok(code)


def test_a_rank_asked_to_send_tensors_out_of_band_stays_torch_free_when_its_class_is():
    # The service asks every rank for out-of-band tensors (HYBRIDFLOW_TENSORS_OUT_OF_BAND); a rank
    # whose class never loaded torch must not load it for that. _subclass is what each
    # rank's actor class is made from; its __init__ is run here without Ray.
    code = (
        "import sys, os; from single_controller.ray import rank_env; "
        "Plain = rank_env._subclass(type('Plain', (), {'__init__': lambda self: None})); "
        "Plain(**{rank_env.RANK_ENV_KWARG: {rank_env.TENSORS_OUT_OF_BAND_ENV: '1', 'RANK': '3'}}); "
        "assert os.environ['RANK'] == '3' and os.environ[rank_env.TENSORS_OUT_OF_BAND_ENV] == '1'; "
        "assert 'torch' not in sys.modules, 'asking for out-of-band tensors loaded torch'; print('ok')"
    )
    assert_fresh_python_prints_ok(code)


def test_from_dict_builds_the_three_parts():
    data = sample()
    assert len(data) == 6
    assert data.batch.batch_size == torch.Size([6])
    assert data.non_tensor_batch["label"].dtype == object
    assert data.non_tensor_batch["label"].tolist() == ["r0", "r1", "r2", "r3", "r4", "r5"]
    assert data.meta_info == {"step": 3}
    single = DataProto.from_single_dict({"x": torch.ones(2), "tag": np.array(["a", "b"], dtype=object)})
    assert single.batch["x"].tolist() == [1.0, 1.0] and single.non_tensor_batch["tag"].tolist() == ["a", "b"]
    assert len(DataProto(non_tensor_batch={"tag": np.array([1, 2, 3])})) == 3
    assert len(DataProto()) == 0


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: DataProto.from_dict({"a": torch.zeros(3), "b": torch.zeros(4)}), "do not share their batch dims"),
        (lambda: DataProto.from_dict({"a": torch.zeros(3, 2)}, num_batch_dims=2), "exactly one batch dimension"),
        (lambda: DataProto.from_dict({"a": torch.zeros(3)}, {"n": [1, 2]}), "has 2 rows, the batch has 3"),
        (lambda: DataProto.from_single_dict({"a": [1, 2]}), "'a' is a list"),
        (lambda: DataProto(non_tensor_batch={"n": [1, 2]}), "must be a numpy array"),
    ],
)
def test_bad_construction_is_a_value_error_naming_the_problem(build, message):
    with pytest.raises(ValueError, match=message) as info:
        build()
    # verl asserts these, so code written for verl that catches AssertionError still works
    assert isinstance(info.value, AssertionError) and isinstance(info.value, DataProtoError)


def test_indexing_slices_masks_and_rows():
    data = sample()
    assert data[1:3].batch["act"].tolist() == [1.0, 2.0] and data[1:3].meta_info == {"step": 3}
    assert data[::2].non_tensor_batch["label"].tolist() == ["r0", "r2", "r4"]
    assert data[[5, 0]].batch["act"].tolist() == [5.0, 0.0]
    assert data[np.array([True, False] * 3)].non_tensor_batch["label"].tolist() == ["r0", "r2", "r4"]
    picked = data[torch.tensor([2, 2])]
    assert picked.batch.batch_size == torch.Size([2]) and picked.non_tensor_batch["label"].tolist() == ["r2", "r2"]
    row = data[4]
    assert isinstance(row, DataProtoItem) and row.batch["obs"].tolist() == [8, 9] and row.non_tensor_batch["label"] == "r4"
    with pytest.raises(TypeError, match="indexed by"):
        data["obs"]


def test_chunk_split_and_concat_round_trip(no_global_padding):
    data = sample()
    pieces = data.chunk(3)
    assert [p.batch["act"].tolist() for p in pieces] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert all(p.meta_info == {"step": 3} for p in pieces)
    back = DataProto.concat(pieces)
    assert torch.equal(back.batch["obs"], data.batch["obs"])
    assert back.non_tensor_batch["label"].tolist() == data.non_tensor_batch["label"].tolist()
    assert [len(p) for p in data.split(4)] == [4, 2]
    with pytest.raises(ValueError, match="6 rows does not split into 4 equal chunks"):
        data.chunk(4)
    with pytest.raises(ValueError, match="non-tensor keys"):
        DataProto.concat([data, DataProto.from_dict({"obs": torch.zeros(1, 2), "act": torch.zeros(1)})])


def test_auto_padding_switches_and_uneven_chunks(no_global_padding):
    data = sample(5)
    assert not data.is_padding_enabled()
    flagged = DataProto.from_dict({"a": torch.arange(5)}, auto_padding=True)
    assert flagged.is_padding_enabled()
    assert [len(p) for p in flagged.chunk(2)] == [3, 2]
    DataProtoConfig.auto_padding = True
    assert data.is_padding_enabled()
    with pytest.raises(ValueError, match="takes a bool"):
        DataProtoConfig.auto_padding = "yes"


def test_auto_padding_from_the_environment(monkeypatch, no_global_padding):
    monkeypatch.setenv("VERL_AUTO_PADDING", "1")
    assert DataProtoConfig.auto_padding and sample().is_padding_enabled()


def test_padding_repeats_the_last_row_in_place_and_divisor_padding_cycles():
    data = sample(3)
    data.padding(2)
    assert data.batch["act"].tolist() == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert data.non_tensor_batch["label"].tolist() == ["r0", "r1", "r2", "r2", "r2"]
    first = sample(3)
    first.padding(1, padding_candidate="first")
    assert first.batch["act"].tolist() == [0.0, 1.0, 2.0, 0.0]

    padded, pad = pad_dataproto_to_divisor(sample(3), size_divisor=7)
    assert pad == 4 and padded.batch["act"].tolist() == [0.0, 1.0, 2.0, 0.0, 1.0, 2.0, 0.0]
    assert unpad_dataproto(padded, pad).non_tensor_batch["label"].tolist() == ["r0", "r1", "r2"]
    assert pad_dataproto_to_divisor(sample(3), size_divisor=3)[1] == 0


def test_repeat_reorder_and_sample_level_repeat():
    data = sample(3)
    assert data.repeat(2).batch["act"].tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
    assert data.repeat(2, interleave=False).non_tensor_batch["label"].tolist() == ["r0", "r1", "r2"] * 2
    assert data.sample_level_repeat([2, 0, 1]).batch["act"].tolist() == [0.0, 0.0, 2.0]
    data.reorder(torch.tensor([2, 0, 1]))
    assert data.batch["act"].tolist() == [2.0, 0.0, 1.0] and data.non_tensor_batch["label"].tolist() == ["r2", "r0", "r1"]


def test_select_pop_rename_and_union():
    data = sample()
    chosen = data.select(batch_keys=["act"], non_tensor_batch_keys=[], meta_info_keys=["step"], deepcopy=True)
    assert set(chosen.batch.keys()) == {"act"} and chosen.non_tensor_batch == {} and chosen.meta_info == {"step": 3}
    popped = data.pop(batch_keys=["obs"], meta_info_keys=["step"])
    assert set(popped.batch.keys()) == {"obs"} and popped.meta_info == {"step": 3}
    assert set(data.batch.keys()) == {"act"} and data.meta_info == {}
    with pytest.raises(ValueError, match=r"pop: no tensor \['obs'\]"):
        data.pop(batch_keys=["obs"])
    data.rename("act", "action")
    assert set(data.batch.keys()) == {"action"}
    data.union(popped)
    assert set(data.batch.keys()) == {"action", "obs"} and data.meta_info == {"step": 3}
    clash = DataProto.from_dict({"obs": torch.zeros(6, 2, dtype=torch.long)})
    with pytest.raises(ValueError, match="'obs' holds different tensors"):
        data.union(clash)


def test_union_helpers_compare_nan_and_object_arrays():
    obs = torch.randn(4, 2)
    merged = union_tensor_dict(TensorDict({"obs": obs}, [4]), TensorDict({"obs": obs, "r": torch.ones(4)}, [4]))
    assert set(merged.keys()) == {"obs", "r"}
    odd = np.array([float("nan"), "nan", 1], dtype=object)
    assert list(union_numpy_dict({"a": odd, "b": np.zeros(2)}, {"a": odd.copy()})) == ["a", "b"]
    with pytest.raises(AssertionError, match="different arrays"):
        union_numpy_dict({"a": np.zeros(3)}, {"a": np.ones(3)})


def test_fold_and_unfold_the_batch_dimension():
    data = sample(3).repeat(2)
    folded = fold_batch_dim(data, new_batch_size=3)
    assert folded.batch["act"].tolist() == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
    assert folded.non_tensor_batch["label"].tolist() == [["r0", "r0"], ["r1", "r1"], ["r2", "r2"]]
    folded.reorder(torch.tensor([2, 0, 1]))
    flat = unfold_batch_dim(folded, batch_dims=2)
    assert flat.batch["act"].tolist() == [2.0, 2.0, 0.0, 0.0, 1.0, 1.0] and flat.meta_info == {"step": 3}


def test_unfold_column_chunks_lays_columns_out_as_rows():
    data = DataProto.from_dict(
        {"wide": torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), "other": torch.tensor([10, 20])}, {"tag": ["a", "b"]}
    )
    out = data.unfold_column_chunks(2, split_keys=["wide"])
    assert out.batch["wide"].tolist() == [[1, 2], [3, 4], [5, 6], [7, 8]]
    assert out.batch["other"].tolist() == [10, 10, 20, 20] and out.non_tensor_batch["tag"].tolist() == ["a", "a", "b", "b"]


def test_make_iterator_is_repeatable_with_a_seed():
    data = sample(8)

    def orders(seed):
        it = data.make_iterator(mini_batch_size=4, epochs=2, seed=seed, dataloader_kwargs={"shuffle": True})
        return [piece.batch["act"].tolist() for piece in it]

    first, again = orders(1), orders(1)
    assert first == again and len(first) == 4 and all(len(batch) == 4 for batch in first)
    assert sorted(first[0] + first[1]) == [float(i) for i in range(8)]
    with pytest.raises(ValueError, match="must divide the 8 rows"):
        data.make_iterator(mini_batch_size=3, epochs=1)


def test_a_piece_pickles_only_its_own_rows(tmp_path):
    big = DataProto.from_dict({"x": torch.arange(1_000_000)})
    piece = big.chunk(1000)[7]
    restored = pickle.loads(pickle.dumps(piece))
    assert restored.batch["x"].tolist()[:2] == [7000, 7001] and len(restored) == 1000
    # torch pickles a view with its whole storage (8 MB here); the piece sends its 8 KB
    assert len(pickle.dumps(piece)) < 50_000
    path = tmp_path / "data.pt"
    sample().save_to_disk(str(path))
    loaded = DataProto.load_from_disk(str(path))
    assert loaded.non_tensor_batch["label"].tolist() == sample().non_tensor_batch["label"].tolist()
    assert loaded.meta_info == {"step": 3}


def test_to_moves_the_batch_and_returns_itself():
    data = sample()
    assert data.to("cpu") is data and data.batch.device == torch.device("cpu")


def test_the_ingress_loads_the_batch_types_before_it_serves():
    # Their first import holds the GIL for a second or more: the replica pays it in its
    # constructor, never with a request's loop waiting. The constructor is given a status
    # table it refuses before it touches Ray, which it reads only after the import.
    code = (
        "import asyncio, sys; from hybridflow.serve.ingress_controllers import ControllingIngress; "
        "assert 'tensordict' not in sys.modules, 'importing the ingress loaded tensordict'; "
        "ingress = object.__new__(ControllingIngress.func_or_class)\n"
        "try: asyncio.run(ingress.__init__([], [], [], {}, 'not a table', {}))\n"
        "except ValueError: pass\n"
        "import ray; assert not ray.is_initialized()\n"
        "assert 'tensordict' in sys.modules and 'single_controller.protocol' in sys.modules; print('ok')"
    )
    assert_fresh_python_prints_ok(code)
