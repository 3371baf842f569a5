"""``@register``: declare how a worker method is dispatched, executed and collected.

The tutorial's import path: ``from single_controller.base.decorator import register,
Dispatch, Execute, collect_all_to_all, register_dispatch_mode``; and verl v0.4's registry
names (``DISPATCH_MODE_FN_REGISTRY``, ``get_predefined_dispatch_fn``,
``update_dispatch_mode``, ``_check_dispatch_mode``) and verl v0.5's mesh dispatch
(``make_nd_compute_dataproto_dispatch_fn``) from the same module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from single_controller.base.dispatch import (
    DISPATCH_TABLE,
    PADDING_KEY,
    DispatchError,
    DispatchSpec,
    collect_all_to_all,
    collect_dp_compute,
    collect_dp_compute_proto,
    collect_megatron_compute,
    collect_megatron_compute_proto,
    collect_megatron_pp_as_dp,
    collect_megatron_pp_only,
    dispatch_all_to_all,
    dispatch_dp_compute,
    dispatch_dp_compute_proto,
    dispatch_megatron_compute,
    dispatch_megatron_compute_proto,
    dispatch_megatron_pp_as_dp,
    dispatch_one_to_all,
)
from single_controller.base.dispatch_registry import (
    DISPATCH_MODE_FN_REGISTRY,
    _check_dispatch_mode,
    dispatch_mode_name,
    get_predefined_dispatch_fn,
    get_predefined_execute_fn,
    register_dispatch_mode,
    resolve_dispatch_mode,
    update_dispatch_mode,
)
from single_controller.base.mesh_dispatch import MeshDispatchSpec, make_nd_compute_dataproto_dispatch_fn
from single_controller.base.modes import Dispatch, Execute, Mode

__all__ = [
    "DISPATCH_MODE_FN_REGISTRY",
    "DISPATCH_TABLE",
    "MAGIC_ATTR",
    "MeshDispatchSpec",
    "PADDING_KEY",
    "Dispatch",
    "DispatchError",
    "DispatchSpec",
    "Execute",
    "MethodSpec",
    "_check_dispatch_mode",
    "collect_all_to_all",
    "collect_dp_compute",
    "collect_dp_compute_proto",
    "collect_megatron_compute",
    "collect_megatron_compute_proto",
    "collect_megatron_pp_as_dp",
    "collect_megatron_pp_only",
    "dispatch_all_to_all",
    "dispatch_dp_compute",
    "dispatch_dp_compute_proto",
    "dispatch_megatron_compute",
    "dispatch_megatron_compute_proto",
    "dispatch_megatron_pp_as_dp",
    "dispatch_one_to_all",
    "get_method_spec",
    "get_predefined_dispatch_fn",
    "get_predefined_execute_fn",
    "make_nd_compute_dataproto_dispatch_fn",
    "register",
    "register_dispatch_mode",
    "update_dispatch_mode",
]

#: Attribute under which ``@register`` stores a method's modes (verl's name, so
#: tools that look for it keep working).
MAGIC_ATTR = "attrs_3141562937"


class MethodSpec(dict):
    """What ``@register`` recorded: dispatch_mode, execute_mode, blocking."""

    @property
    def dispatch_spec(self) -> DispatchSpec:
        return resolve_dispatch_mode(self["dispatch_mode"])

    @property
    def dispatch_name(self) -> str:
        return dispatch_mode_name(self["dispatch_mode"])

    @property
    def execute_mode(self) -> Mode:
        return self["execute_mode"]

    @property
    def blocking(self) -> bool:
        return self["blocking"]


def _check_execute_mode(mode: Any) -> Mode:
    if isinstance(mode, str) and mode in Execute:
        return Execute[mode]
    if isinstance(mode, Mode) and mode in Execute:
        return mode
    raise ValueError(f"unknown execute mode {mode!r}; known: {', '.join(m.name for m in Execute)}")


def register(
    dispatch_mode: Mode | str | dict = Dispatch.ALL_TO_ALL,
    execute_mode: Mode | str = Execute.ALL,
    blocking: bool = True,
    materialize_futures: bool = True,
) -> Callable[[Callable], Callable]:
    """Mark a worker method for group binding.

    The worker group gets a method of the same name that dispatches the call's
    arguments by ``dispatch_mode`` (a :class:`Dispatch` member, its name, or a
    ``{'dispatch_fn', 'collect_fn'}`` dict), runs it on the ranks ``execute_mode``
    names, and collects the outputs. With ``blocking=False`` the group method
    returns futures instead of values: a ``DataProtoFuture`` when a PROTO mode was
    given a DataProto, else Ray futures. An unknown mode raises ``ValueError`` here,
    when the method is defined, not on first call.

    ``materialize_futures`` is verl's switch for resolving ``DataProtoFuture``
    arguments; here they are always resolved before dispatch (on the caller), so it is
    accepted for compatibility and has no effect.
    """
    resolve_dispatch_mode(dispatch_mode)
    if isinstance(dispatch_mode, str):
        dispatch_mode = Dispatch[dispatch_mode]
    execute_mode = _check_execute_mode(execute_mode)

    def decorator(func: Callable) -> Callable:
        if not callable(func):
            raise TypeError(f"@register decorates methods, got {func!r}")
        setattr(
            func,
            MAGIC_ATTR,
            MethodSpec(dispatch_mode=dispatch_mode, execute_mode=execute_mode, blocking=bool(blocking)),
        )
        return func

    return decorator


def get_method_spec(method: Any) -> MethodSpec | None:
    """The :class:`MethodSpec` ``@register`` attached to ``method``, or None."""
    spec = getattr(method, MAGIC_ATTR, None)
    return spec if isinstance(spec, MethodSpec) else None
