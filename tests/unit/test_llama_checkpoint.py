"""The layer's checkpoint reader and config checks, in process (no megatron, no Ray): what a
Hugging Face Llama safetensors checkpoint gives, and the ValueError for each bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from single_controller.models.llama import DEFAULT_MAX_PARAMETERS, layer_spec
from single_controller.models.llama_checkpoint import DOWN, GATE, UP, LlamaMLPCheckpoint

HIDDEN, FFN, LAYERS = 16, 24, 3


def _mlp(layer: int, hidden: int = HIDDEN, ffn: int = FFN, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(layer)
    prefix = f"model.layers.{layer}.mlp"
    return {
        f"{prefix}.gate_proj.weight": torch.randn(ffn, hidden, generator=g).to(dtype),
        f"{prefix}.up_proj.weight": torch.randn(ffn, hidden, generator=g).to(dtype),
        f"{prefix}.down_proj.weight": torch.randn(hidden, ffn, generator=g).to(dtype),
    }


def _model(**changes) -> dict[str, torch.Tensor]:
    tensors = {"model.embed_tokens.weight": torch.zeros(8, HIDDEN)}
    for layer in range(LAYERS):
        tensors.update(_mlp(layer))
        tensors[f"model.layers.{layer}.input_layernorm.weight"] = torch.ones(HIDDEN)
    tensors.update(changes)
    return {k: v for k, v in tensors.items() if v is not None}


@pytest.fixture
def file(tmp_path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file(_model(), str(path))
    return path


def _sharded(root: Path, with_index: bool) -> Path:
    """Layer 0 and the embedding in one shard, layers 1 and 2 in another."""
    root.mkdir()
    tensors = _model()
    first = {k: v for k, v in tensors.items() if not k.startswith(("model.layers.1.", "model.layers.2."))}
    second = {k: v for k, v in tensors.items() if k not in first}
    save_file(first, str(root / "model-00001-of-00002.safetensors"))
    save_file(second, str(root / "model-00002-of-00002.safetensors"))
    if with_index:
        weight_map = {k: "model-00001-of-00002.safetensors" for k in first}
        weight_map.update({k: "model-00002-of-00002.safetensors" for k in second})
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


@pytest.mark.parametrize("layout", ["file", "index", "no_index"])
def test_sizes_and_slices_from_each_layout(tmp_path, file, layout):
    path = {
        "file": lambda: file,
        "index": lambda: _sharded(tmp_path / "sharded", with_index=True),
        "no_index": lambda: _sharded(tmp_path / "plain", with_index=False),
    }[layout]()
    expected = _mlp(2)
    checkpoint = LlamaMLPCheckpoint(path, 2)
    assert (checkpoint.hidden_size, checkpoint.intermediate_size) == (HIDDEN, FFN)
    assert torch.equal(checkpoint.read(GATE, slice(6, 12)), expected["model.layers.2.mlp.gate_proj.weight"][6:12])
    assert torch.equal(checkpoint.read(UP, slice(0, 6)), expected["model.layers.2.mlp.up_proj.weight"][:6])
    down = checkpoint.read(DOWN, slice(4, 8), slice(18, 24))
    assert torch.equal(down, expected["model.layers.2.mlp.down_proj.weight"][4:8, 18:])


def test_sizes_come_from_the_checkpoint_when_the_config_omits_them(file):
    spec = layer_spec({"checkpoint": str(file), "layer_index": 0}, tp=4)
    assert (spec.hidden_size, spec.intermediate_size, spec.hidden_act) == (HIDDEN, FFN, "silu")
    assert spec.checkpoint is not None and spec.checkpoint.layer_index == 0
    # the same sizes given explicitly are accepted
    layer_spec({"checkpoint": str(file), "layer_index": 0, "hidden_size": HIDDEN, "intermediate_size": FFN}, 4)


def test_bfloat16_checkpoint_gives_its_values(tmp_path):
    path = tmp_path / "bf16.safetensors"
    tensors = _mlp(0, dtype=torch.bfloat16)
    save_file(tensors, str(path))
    rows = LlamaMLPCheckpoint(path, 0).read(GATE, slice(0, 4))
    assert rows.dtype == torch.bfloat16
    assert torch.equal(rows, tensors["model.layers.0.mlp.gate_proj.weight"][:4])


def _error(fn) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


def test_missing_paths(tmp_path):
    assert "does not exist" in _error(lambda: LlamaMLPCheckpoint(tmp_path / "nope.safetensors", 0))
    (tmp_path / "empty").mkdir()
    assert "holds no .safetensors file" in _error(lambda: LlamaMLPCheckpoint(tmp_path / "empty", 0))
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    assert "not a readable safetensors file" in _error(lambda: LlamaMLPCheckpoint(tmp_path / "junk.safetensors", 0))
    assert "checkpoint must be a path" in _error(lambda: LlamaMLPCheckpoint(42, 0))  # type: ignore[arg-type]


def test_layer_index_out_of_range_or_not_an_integer(file):
    assert "layer_index 3 out of range" in _error(lambda: LlamaMLPCheckpoint(file, 3))
    assert "has layers 0..2" in _error(lambda: LlamaMLPCheckpoint(file, -1))
    assert "layer_index must be an integer" in _error(lambda: LlamaMLPCheckpoint(file, "1"))  # type: ignore[arg-type]
    assert "layer_index must be an integer" in _error(lambda: LlamaMLPCheckpoint(file, True))


def test_missing_tensor_names(tmp_path):
    path = tmp_path / "no_up.safetensors"
    save_file(_model(**{"model.layers.1.mlp.up_proj.weight": None}), str(path))
    assert "lacks model.layers.1.mlp.up_proj.weight" in _error(lambda: LlamaMLPCheckpoint(path, 1))
    LlamaMLPCheckpoint(path, 0)  # the other layers still load
    other = tmp_path / "not_llama.safetensors"
    save_file({"transformer.h.0.mlp.c_fc.weight": torch.zeros(4, 4)}, str(other))
    assert "no model.layers.* tensors" in _error(lambda: LlamaMLPCheckpoint(other, 0))


def test_wrong_shapes(tmp_path):
    cases = {
        "up_differs": {"model.layers.0.mlp.up_proj.weight": torch.zeros(FFN + 1, HIDDEN)},
        "down_not_transposed": {"model.layers.0.mlp.down_proj.weight": torch.zeros(FFN, HIDDEN)},
        "one_dimensional": {
            "model.layers.0.mlp.gate_proj.weight": torch.zeros(FFN),
            "model.layers.0.mlp.up_proj.weight": torch.zeros(FFN),
        },
    }
    for name, change in cases.items():
        path = tmp_path / f"{name}.safetensors"
        save_file(_model(**change), str(path))
        message = _error(lambda path=path: LlamaMLPCheckpoint(path, 0))
        assert "are not [intermediate, hidden], [intermediate, hidden] and [hidden, intermediate]" in message, name


def test_biases_and_integer_weights_are_refused(tmp_path):
    biased = tmp_path / "biased.safetensors"
    save_file(_model(**{"model.layers.0.mlp.up_proj.bias": torch.zeros(FFN)}), str(biased))
    assert "MLP biases (model.layers.0.mlp.up_proj.bias)" in _error(lambda: LlamaMLPCheckpoint(biased, 0))
    quantised = tmp_path / "int8.safetensors"
    save_file(_model(**{"model.layers.0.mlp.down_proj.weight": torch.zeros(HIDDEN, FFN, dtype=torch.int8)}), str(quantised))
    assert "model.layers.0.mlp.down_proj.weight is I8" in _error(lambda: LlamaMLPCheckpoint(quantised, 0))


def test_bad_index_files(tmp_path):
    root = _sharded(tmp_path / "sharded", with_index=True)
    index = root / "model.safetensors.index.json"
    good = json.loads(index.read_text())
    index.write_text("{not json")
    assert "is not a safetensors index" in _error(lambda: LlamaMLPCheckpoint(root, 0))
    index.write_text(json.dumps({"weight_map": ["a", "b"]}))
    assert "weight_map must be an object" in _error(lambda: LlamaMLPCheckpoint(root, 0))
    escaping = dict(good["weight_map"], **{"model.layers.0.mlp.gate_proj.weight": "../model.safetensors"})
    index.write_text(json.dumps({"weight_map": escaping}))
    assert "not a file name in" in _error(lambda: LlamaMLPCheckpoint(root, 0))
    # the index names a shard that does not hold the tensor
    wrong = dict(good["weight_map"], **{"model.layers.1.mlp.gate_proj.weight": "model-00001-of-00002.safetensors"})
    index.write_text(json.dumps({"weight_map": wrong}))
    assert "lacks model.layers.1.mlp.gate_proj.weight (named there by the checkpoint's index)" in _error(
        lambda: LlamaMLPCheckpoint(root, 1)
    )
    index.write_text(json.dumps(good))
    (root / "other.safetensors.index.json").write_text(json.dumps(good))
    assert "several index files" in _error(lambda: LlamaMLPCheckpoint(root, 0))


def test_config_against_checkpoint_and_tp(tmp_path, file):
    ckpt = {"checkpoint": str(file), "layer_index": 1}
    assert "config hidden_size 32 but the checkpoint's layer 1 has 16" in _error(
        lambda: layer_spec({**ckpt, "hidden_size": 32}, tp=1)
    )
    assert "config intermediate_size 48 but the checkpoint's layer 1 has 24" in _error(
        lambda: layer_spec({**ckpt, "intermediate_size": 48}, tp=1)
    )
    # intermediate 24 splits over 1, 2, 3, 4 ranks, not 5
    layer_spec(ckpt, tp=4)
    assert "intermediate_size 24 is not divisible by tp 5" in _error(lambda: layer_spec(ckpt, tp=5))
    assert "a checkpoint needs layer_index" in _error(lambda: layer_spec({"checkpoint": str(file)}, tp=1))
    assert "layer_index is given but no checkpoint" in _error(
        lambda: layer_spec({"hidden_size": 8, "intermediate_size": 8, "layer_index": 0}, tp=1)
    )


def test_config_values(tmp_path):
    base = {"hidden_size": 8, "intermediate_size": 16}
    assert "config needs integer hidden_size and intermediate_size" in _error(lambda: layer_spec({}, tp=1))
    assert "hidden_size must be an integer, got '8'" in _error(lambda: layer_spec({**base, "hidden_size": "8"}, 1))
    assert "must be positive" in _error(lambda: layer_spec({**base, "hidden_size": 0}, tp=1))
    assert "seed must be in [0, 2**64)" in _error(lambda: layer_spec({**base, "seed": -1}, tp=1))
    assert "seed must be an integer" in _error(lambda: layer_spec({**base, "seed": 1.5}, tp=1))
    assert "unknown hidden_act 'swishy'" in _error(lambda: layer_spec({**base, "hidden_act": "swishy"}, tp=1))
    assert "config must be an object of layer settings, got str" in _error(lambda: layer_spec("big", tp=1))


def test_layer_size_is_bounded():
    tutorial = {"hidden_size": 4096, "intermediate_size": 11008}
    assert layer_spec(tutorial, tp=4).parameter_count == 3 * 4096 * 11008 <= DEFAULT_MAX_PARAMETERS
    # a 100-byte request for a 3 * 2**40-parameter layer is refused by the default bound
    huge = {"hidden_size": 1 << 20, "intermediate_size": 1 << 20}
    assert f"exceeds max_parameters {DEFAULT_MAX_PARAMETERS}" in _error(lambda: layer_spec(huge, tp=1))
    # the bound is the caller's: exactly at it passes, one under fails
    exact = 3 * 8 * 16
    layer_spec({"hidden_size": 8, "intermediate_size": 16}, tp=1, max_parameters=exact)
    message = _error(lambda: layer_spec({"hidden_size": 8, "intermediate_size": 16}, tp=1, max_parameters=exact - 1))
    assert f"a layer of {exact} parameters (3 x hidden_size 8 x intermediate_size 16) exceeds max_parameters" in message


def test_checkpoint_layer_size_is_bounded(file):
    assert "exceeds max_parameters 100" in _error(
        lambda: layer_spec({"checkpoint": str(file), "layer_index": 0}, tp=1, max_parameters=100)
    )


def _linked(tmp_path: Path, with_index: bool, link: str) -> tuple[Path, Path, Path]:
    """(an allowed directory, a checkpoint in it, the file outside it that ``link``, one of
    the checkpoint's files, is a symlink to)."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    root = _sharded(allowed / "llama", with_index)
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / link
    (root / link).rename(target)
    (root / link).symlink_to(target)
    return allowed, root, target


@pytest.mark.parametrize(
    ("with_index", "link"),
    [
        (True, "model-00002-of-00002.safetensors"),
        (True, "model.safetensors.index.json"),
        (False, "model-00002-of-00002.safetensors"),
    ],
    ids=["index-shard", "index-file", "no-index-shard"],
)
def test_every_file_read_resolves_inside_the_allowed_directories(tmp_path, with_index, link):
    allowed, root, target = _linked(tmp_path, with_index, link)
    for layer in (0, 2):
        message = _error(lambda layer=layer: LlamaMLPCheckpoint(root, layer, allowed_dirs=[allowed]))
        assert f"checkpoint file {root / link} (resolved: {target}) is outside the directories" in message
        assert f"({allowed})" in message
        assert "outside the directories" in _error(
            lambda layer=layer: layer_spec({"checkpoint": str(root), "layer_index": layer}, 1, checkpoint_dirs=[allowed])
        )
    # the link's target allowed too, or no bound at all: the same checkpoint loads
    for dirs in ([allowed, target.parent], None):
        checkpoint = LlamaMLPCheckpoint(root, 2, allowed_dirs=dirs)
        assert checkpoint.hidden_size == HIDDEN
        assert torch.equal(checkpoint.read(UP, slice(0, 3)), _mlp(2)["model.layers.2.mlp.up_proj.weight"][:3])


def test_the_named_path_resolves_inside_the_allowed_directories(tmp_path, file):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "model.safetensors").symlink_to(file)
    assert f"(resolved: {file}) is outside the directories this layer may read ({allowed})" in _error(
        lambda: LlamaMLPCheckpoint(allowed / "model.safetensors", 0, allowed_dirs=[allowed])
    )
    assert f"checkpoint file {allowed}/../model.safetensors (resolved: {file}) is outside" in _error(
        lambda: LlamaMLPCheckpoint(f"{allowed}/../model.safetensors", 0, allowed_dirs=[allowed])
    )
    assert "this layer may read (none)" in _error(lambda: LlamaMLPCheckpoint(file, 0, allowed_dirs=[]))
    # a missing path outside is refused as outside, without saying whether it exists
    assert "is outside the directories" in _error(
        lambda: LlamaMLPCheckpoint(tmp_path / "nope.safetensors", 0, allowed_dirs=[allowed])
    )
    assert LlamaMLPCheckpoint(file, 0, allowed_dirs=[tmp_path]).hidden_size == HIDDEN
    assert "allowed_dirs must be a list of directories" in _error(
        lambda: LlamaMLPCheckpoint(file, 0, allowed_dirs=str(tmp_path))  # type: ignore[arg-type]
    )
