"""A tensor-parallel Llama MLP built from megatron-core's own parallel layers.

``gate_up_proj`` is one ColumnParallelLinear of ``2 * intermediate_size`` outputs with
``stride=2``: rank ``r``'s shard ``[2*ffn/tp, hidden]`` is gate rows ``[r*ffn/tp,
(r+1)*ffn/tp)`` followed by the same rows of up, so a rank needs no communication before
the activation. (With stride 1 over a ``[gate; up]`` master, tp=2 would give rank 0 all of
gate and rank 1 all of up, and ``chunk(2)`` would pair the wrong rows.) ``down_proj`` is a
RowParallelLinear (``[hidden, ffn/tp]``, columns ``[r*ffn/tp, (r+1)*ffn/tp)``) whose forward
all-reduces the partial sums.

Every rank fills only its own shard, from one of two sources:

- a Hugging Face Llama checkpoint (``checkpoint`` and ``layer_index`` in the config): the
  rank's rows and columns read from the memory-mapped safetensors file(s);
- a seeded random init (``seed``, default 0): gate, up and down transposed (each
  ``[intermediate, hidden]``) are each read in row-major order as a sequence of blocks of
  ``_BLOCK_ELEMENTS`` elements, and block ``k`` is drawn whole from its own torch generator,
  seeded from the layer's seed, the matrix and ``k``. A rank's shard (rows of the three) is
  one run of elements of each, so it draws only the blocks its run overlaps: without the
  full master weight megatron's CPU init would draw on every rank, and with one generator
  seeding per block, so the time follows the shard's parameters whatever the layer's
  shape. The weights depend on the seed only: the same after a rebuild, and the same full
  matrices whatever the tp.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from single_controller.megatron.core_import import import_megatron_core
from single_controller.models.llama_checkpoint import DOWN, GATE, UP, LlamaMLPCheckpoint

#: Activations by Hugging Face's ``hidden_act`` names.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}

INIT_STD = 0.02

#: The largest layer (``3 * hidden * intermediate`` parameters, all ranks together) built
#: unless told otherwise: 2**28, 1 GiB of float32, twice the tutorial's 4096 x 11008 layer.
DEFAULT_MAX_PARAMETERS = 1 << 28

#: Elements drawn from one generator (256 KiB of float32): the last block of a matrix is
#: drawn whole too, and only its part inside the matrix kept.
_BLOCK_ELEMENTS = 1 << 16
# torch's CPU generator keeps 32 bits of its seed: block streams are numbered within 2**32,
# each matrix in its own 2**30 range, so no two blocks of a layer share a stream; a matrix
# may then hold up to 2**30 blocks.
_MATRIX_STRIDE = 1 << 30
_MATRIX_STREAM = {GATE: 0, UP: 1, DOWN: 2}
_MAX_MATRIX_ELEMENTS = _MATRIX_STRIDE * _BLOCK_ELEMENTS
#: Rows copied at a time from a checkpoint: bounds its pages mapped at once.
_BLOCK_ROWS = 256
#: Elements of down's transpose drawn at a time into a scratch buffer, then copied into
#: the shard's columns.
_DOWN_CHUNK_ELEMENTS = 16 * _BLOCK_ELEMENTS


def _as_dict(config: Any) -> dict[str, Any]:
    """A dict, an OmegaConf config, or an object with attributes (a transformers LlamaConfig)."""
    if isinstance(config, Mapping):
        return dict(config)
    try:
        from omegaconf import OmegaConf

        return dict(OmegaConf.to_container(config, resolve=True))
    except Exception:
        pass
    try:
        return dict(vars(config))
    except TypeError:
        raise ValueError(f"config must be an object of layer settings, got {type(config).__name__}") from None


def _optional_int(cfg: Mapping[str, Any], key: str) -> int | None:
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    return value


@dataclass(frozen=True)
class LlamaMLPSpec:
    """A layer as a config describes it, checked before anything is allocated."""

    hidden_size: int
    intermediate_size: int
    hidden_act: str
    seed: int
    checkpoint: LlamaMLPCheckpoint | None

    @property
    def parameter_count(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size


def layer_spec(
    config: Any,
    tp: int,
    max_parameters: int | None = DEFAULT_MAX_PARAMETERS,
    checkpoint_dirs: Sequence[str | os.PathLike[str]] | None = None,
) -> LlamaMLPSpec:
    """Check ``config`` for a layer split over ``tp`` ranks; sizes from the checkpoint's
    headers when the config leaves them out. A checkpoint's files must all resolve inside
    ``checkpoint_dirs`` (None: anywhere). Raises ValueError naming the problem."""
    cfg = _as_dict(config)
    hidden, ffn = _optional_int(cfg, "hidden_size"), _optional_int(cfg, "intermediate_size")
    layer_index, seed = _optional_int(cfg, "layer_index"), _optional_int(cfg, "seed")
    checkpoint = None
    if cfg.get("checkpoint") is not None:
        if layer_index is None:
            raise ValueError("a checkpoint needs layer_index: which of its layers to load")
        checkpoint = LlamaMLPCheckpoint(cfg["checkpoint"], layer_index, allowed_dirs=checkpoint_dirs)
        for key, given, found in (
            ("hidden_size", hidden, checkpoint.hidden_size),
            ("intermediate_size", ffn, checkpoint.intermediate_size),
        ):
            if given is not None and given != found:
                raise ValueError(
                    f"config {key} {given} but the checkpoint's layer {layer_index} has {found} "
                    f"(gate_proj is [{checkpoint.intermediate_size}, {checkpoint.hidden_size}])"
                )
        hidden, ffn = checkpoint.hidden_size, checkpoint.intermediate_size
    elif layer_index is not None:
        raise ValueError("layer_index is given but no checkpoint to read it from")
    if hidden is None or ffn is None:
        raise ValueError("config needs integer hidden_size and intermediate_size (or a checkpoint to read them from)")
    if hidden <= 0 or ffn <= 0:
        raise ValueError(f"hidden_size and intermediate_size must be positive, got {hidden}, {ffn}")
    if hidden * ffn > _MAX_MATRIX_ELEMENTS:
        raise ValueError(f"hidden_size x intermediate_size must be at most 2**46, got {hidden} x {ffn}")
    act = cfg.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"unknown hidden_act {act!r}; known: {', '.join(ACTIVATIONS)}")
    if cfg.get("tp") is not None and _optional_int(cfg, "tp") != tp:
        raise ValueError(f"config tp={cfg['tp']} but megatron's tensor-parallel size is {tp}")
    if ffn % tp:
        raise ValueError(f"intermediate_size {ffn} is not divisible by tp {tp}")
    if (_optional_int(cfg, "pretraining_tp") or 1) != 1:
        raise ValueError("pretraining_tp > 1 is not supported")
    seed = 0 if seed is None else seed
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    spec = LlamaMLPSpec(hidden, ffn, act, seed, checkpoint)
    if max_parameters is not None and spec.parameter_count > max_parameters:
        raise ValueError(
            f"a layer of {spec.parameter_count} parameters (3 x hidden_size {hidden} x intermediate_size {ffn}) "
            f"exceeds max_parameters {max_parameters}"
        )
    return spec


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def fill_master_rows(out: torch.Tensor, seed: int, matrix: str, first_row: int) -> None:
    """``out[i]`` = row ``first_row + i`` of the seeded master ``matrix`` (GATE, UP, or DOWN
    transposed, each ``[intermediate, hidden]``), N(0, INIT_STD): any rank can draw any rows.

    ``out`` (contiguous ``[rows, hidden]``) is elements ``[first_row * hidden, ...)`` of the
    matrix in row-major order. Each block of ``_BLOCK_ELEMENTS`` elements they overlap is
    drawn whole from its own generator (torch's normal draw depends on the size drawn):
    straight into ``out`` when ``out`` holds all of it, else into a scratch block of which
    the overlapping part is copied. So this seeds a generator ``numel / _BLOCK_ELEMENTS + 2``
    times at most, whatever the shape."""
    if out.dim() != 2 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [rows, hidden] tensor, got {list(out.shape)}")
    flat = out.view(-1)
    begin = first_row * out.shape[1]
    end = begin + flat.numel()
    if begin < 0 or end > _MAX_MATRIX_ELEMENTS:
        raise ValueError(f"elements [{begin}, {end}) are outside a matrix of at most 2**46 elements")
    base = (_splitmix64(seed) >> 32) + _MATRIX_STREAM[matrix] * _MATRIX_STRIDE
    generator = torch.Generator()
    scratch: torch.Tensor | None = None
    for block in range(begin // _BLOCK_ELEMENTS, -(-end // _BLOCK_ELEMENTS)):
        low, high = block * _BLOCK_ELEMENTS, (block + 1) * _BLOCK_ELEMENTS
        generator.manual_seed((base + block) & 0xFFFFFFFF)
        if begin <= low and high <= end:
            flat[low - begin : high - begin].normal_(0.0, INIT_STD, generator=generator)
            continue
        if scratch is None:
            scratch = torch.empty(_BLOCK_ELEMENTS, dtype=out.dtype)
        scratch.normal_(0.0, INIT_STD, generator=generator)
        first, last = max(low, begin), min(high, end)
        flat[first - begin : last - begin].copy_(scratch[first - low : last - low])


def _megatron_must_not_init(weight: torch.Tensor) -> None:
    raise AssertionError("megatron was asked not to initialise; ParallelLlamaMLP fills each shard itself")


class ParallelLlamaMLP(torch.nn.Module):
    """``ParallelLlamaMLP(config=config, megatron_config=OmegaConf.create({'sequence_parallel_enabled': False}))``.

    ``config`` (dict or OmegaConf): hidden_size, intermediate_size, hidden_act (default
    silu), pretraining_tp, seed (default 0), optionally tp (checked against megatron's tp
    size), and ``checkpoint`` (a safetensors file or directory in the Hugging Face Llama
    layout) with ``layer_index`` to load that layer's weights instead of the seeded init;
    the sizes may then be left out. Call it after ``initialize_model_parallel``. A layer of
    more than ``max_parameters`` parameters, or a checkpoint with a file that resolves
    outside ``checkpoint_dirs`` (None: no such bound, for a program that names its own
    paths), is refused before anything is allocated.
    """

    def __init__(
        self,
        config: Any,
        megatron_config: Any = None,
        *,
        max_parameters: int | None = DEFAULT_MAX_PARAMETERS,
        checkpoint_dirs: Sequence[str | os.PathLike[str]] | None = None,
    ) -> None:
        super().__init__()
        import_megatron_core()
        from megatron.core import ModelParallelConfig, parallel_state
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        tp = parallel_state.get_tensor_model_parallel_world_size()
        spec = layer_spec(config, tp, max_parameters, checkpoint_dirs)
        mcfg = _as_dict(megatron_config) if megatron_config is not None else {}
        parallel_config = ModelParallelConfig(
            tensor_model_parallel_size=tp,
            sequence_parallel=bool(mcfg.get("sequence_parallel_enabled", False)),
            # megatron allocates the rank's shard only (on CPU; moved to the device later)
            # and draws nothing: the shard is filled below.
            use_cpu_initialization=True,
            perform_initialization=False,
            params_dtype=torch.float32,
        )
        hidden, ffn = spec.hidden_size, spec.intermediate_size
        self.spec, self.hidden_size, self.intermediate_size, self.tp = spec, hidden, ffn, tp
        self.act_fn = ACTIVATIONS[spec.hidden_act]
        self.gate_up_proj = ColumnParallelLinear(
            hidden, 2 * ffn, config=parallel_config, init_method=_megatron_must_not_init, bias=False,
            gather_output=False, stride=2, skip_bias_add=True,
        )
        self.down_proj = RowParallelLinear(
            ffn, hidden, config=parallel_config, init_method=_megatron_must_not_init, bias=False,
            input_is_parallel=True, skip_bias_add=True,
        )
        # What megatron's own init would have marked (its checkpointing reads these).
        set_tensor_model_parallel_attributes(self.gate_up_proj.weight, is_parallel=True, dim=0, stride=2)
        set_tensor_model_parallel_attributes(self.down_proj.weight, is_parallel=True, dim=1, stride=1)
        rank = parallel_state.get_tensor_model_parallel_rank()
        with torch.no_grad():
            if spec.checkpoint is not None:
                self._load_shard(spec.checkpoint, rank)
            else:
                self._init_shard(spec.seed, rank)

    def _shard_rows(self, rank: int) -> tuple[int, int]:
        per_rank = self.intermediate_size // self.tp
        return rank * per_rank, (rank + 1) * per_rank

    def _load_shard(self, checkpoint: LlamaMLPCheckpoint, rank: int) -> None:
        start, stop = self._shard_rows(rank)
        per_rank, gate_up, down = stop - start, self.gate_up_proj.weight, self.down_proj.weight
        for begin in range(0, per_rank, _BLOCK_ROWS):
            end = min(begin + _BLOCK_ROWS, per_rank)
            rows = slice(start + begin, start + end)
            gate_up[begin:end].copy_(checkpoint.read(GATE, rows))
            gate_up[per_rank + begin : per_rank + end].copy_(checkpoint.read(UP, rows))
        for begin in range(0, self.hidden_size, _BLOCK_ROWS):
            end = min(begin + _BLOCK_ROWS, self.hidden_size)
            down[begin:end].copy_(checkpoint.read(DOWN, slice(begin, end), slice(start, stop)))

    def _init_shard(self, seed: int, rank: int) -> None:
        start, stop = self._shard_rows(rank)
        gate_up = self.gate_up_proj.weight
        fill_master_rows(gate_up[: stop - start], seed, GATE, start)
        fill_master_rows(gate_up[stop - start :], seed, UP, start)
        # down's shard is columns: draw them as rows of down transposed, a chunk of rows at
        # a time (of at least _DOWN_CHUNK_ELEMENTS elements, so that the blocks drawn twice,
        # at the chunks' ends, stay a small part)
        down = self.down_proj.weight
        chunk_rows = -(-_DOWN_CHUNK_ELEMENTS // self.hidden_size)
        for begin in range(0, stop - start, chunk_rows):
            chunk = torch.empty(min(chunk_rows, stop - start - begin), self.hidden_size, dtype=down.dtype)
            fill_master_rows(chunk, seed, DOWN, start + begin)
            down[:, begin : begin + len(chunk)].copy_(chunk.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"input must be [seq, batch, {self.hidden_size}], got {list(x.shape)}")
        if x.dtype != self.gate_up_proj.weight.dtype:
            raise ValueError(f"input must be {self.gate_up_proj.weight.dtype}, got {x.dtype}")
        gate_up, _ = self.gate_up_proj(x)
        gate, up = gate_up.chunk(2, dim=-1)
        out, _ = self.down_proj(self.act_fn(gate) * up)
        return out
