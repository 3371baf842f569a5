"""Bounds on what a body may make a decoder build, so that a small body cannot cost
gigabytes or minutes. One frozen value, passed in by callers (the server builds it from
its config); every decoder takes ``limits=``. A server decodes requests within its
config's limits (:data:`DEFAULT_LIMITS` by default); a client reads the answers of the
service it chose within :data:`CLIENT_LIMITS`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["CLIENT_LIMITS", "DEFAULT_LIMITS", "MAX_DEPTH", "WireLimits"]

#: The deepest nesting of lists and objects the service takes, and the bound of
#: ``max_depth``: the state store keeps any value this deep, and what ``state_dict()``
#: wraps around it (hybridflow.state.codec allows a margin more), so every call the
#: service accepts can be journaled and snapshotted.
MAX_DEPTH = 100


@dataclass(frozen=True)
class WireLimits:
    """Every field is a positive integer."""

    #: Tensors in one body: JSON tensor objects, safetensors entries, OIP inputs or outputs.
    max_tensors: int = 4096
    #: JSON values in one body (every number, string, true/false/null, list and object
    #: counts one; 1 Mi values is 4 MiB of FP32 data, about 100 MiB once parsed). Checked
    #: on the bytes before parsing. Large tensors belong in safetensors or binary data.
    max_json_values: int = 1 << 20
    #: JSON values an answer may make (a tensor counts its number of elements); larger
    #: answers are refused with a pointer to safetensors or binary data.
    max_json_output_values: int = 1 << 20
    #: Largest product of a shape's nonzero dimensions (a bound on elements that also keeps
    #: shapes such as [2**62, 2**62, 0] from overflowing int64 arithmetic).
    max_tensor_elements: int = 1 << 40
    #: Dimensions of one tensor.
    max_ndim: int = 64
    #: Nesting of lists and objects (deeper is most likely a cycle or an attack); at most
    #: :data:`MAX_DEPTH`.
    max_depth: int = MAX_DEPTH
    #: A split job's pieces times the tensors cut into them (the views it makes).
    max_split_views: int = 1 << 16

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"limits.{field.name} must be a positive integer, got {value!r}")
        if self.max_depth > MAX_DEPTH:
            raise ValueError(
                f"limits.max_depth must be at most {MAX_DEPTH} (what the state store keeps), got {self.max_depth}"
            )

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> WireLimits:
        """Limits from a config mapping (absent keys keep their defaults); an unknown key
        is a ValueError that names it."""
        values = dict(values or {})
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"limits: unknown field {unknown[0]!r}; known: {', '.join(sorted(known))}")
        return cls(**values)


DEFAULT_LIMITS = WireLimits()

#: What a client sends and reads back: a service may raise its own limits as far as its
#: config allows, so only the memory at hand bounds the counts; nesting stays within
#: :data:`MAX_DEPTH` and every shape is still checked against the bytes that carry it.
CLIENT_LIMITS = WireLimits(
    max_tensors=1 << 40, max_json_values=1 << 50, max_json_output_values=1 << 50, max_tensor_elements=1 << 62,
    max_split_views=1 << 40,
)
