"""Looking up, adding and replacing dispatch modes: verl v0.4's registry API on the one
dispatch table (:data:`single_controller.base.dispatch.DISPATCH_TABLE`).

``DISPATCH_MODE_FN_REGISTRY`` *is* that table, so a mode added or replaced here is what
every group dispatches with, and saving and restoring it (``copy()``, ``clear()``,
``update()``) restores the modes. Its entries read as verl's dicts
(``{"dispatch_fn": f, "collect_fn": g}``); a plain dict put in it works as well.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from single_controller.base.dispatch import (
    DISPATCH_TABLE,
    CollectFn,
    DispatchError,
    DispatchFn,
    DispatchSpec,
)
from single_controller.base.modes import Dispatch, Execute, Mode

#: verl's name for the dispatch table (the same dict object).
DISPATCH_MODE_FN_REGISTRY: dict[Mode, DispatchSpec] = DISPATCH_TABLE

#: Which group method runs each execute mode (verl's ``get_predefined_execute_fn`` table).
EXECUTE_FN_NAMES: dict[Mode, str] = {Execute.ALL: "execute_all", Execute.RANK_ZERO: "execute_rank_zero"}


def _check_dispatch_mode(dispatch_mode: Any) -> None:
    """Accept a registered :class:`Dispatch` mode or a custom ``{'dispatch_fn',
    'collect_fn'}`` dict; ``DispatchError`` (a ``ValueError``) for anything else."""
    if isinstance(dispatch_mode, Mode):
        if dispatch_mode not in Dispatch:
            raise DispatchError(f"{dispatch_mode!r} is not a registered Dispatch mode")
        return
    if isinstance(dispatch_mode, Mapping):
        DispatchSpec.of(dispatch_mode)
        return
    raise DispatchError(f"dispatch_mode must be a Dispatch mode or a dict, got {dispatch_mode!r}")


def get_predefined_dispatch_fn(dispatch_mode: Mode) -> DispatchSpec:
    """The ``{'dispatch_fn', 'collect_fn'}`` entry of a named mode."""
    return resolve_dispatch_mode(dispatch_mode)


def get_predefined_execute_fn(execute_mode: Mode) -> dict[str, str]:
    """``{'execute_fn_name': 'execute_all' | 'execute_rank_zero'}`` for an execute mode."""
    if execute_mode not in EXECUTE_FN_NAMES:
        raise ValueError(f"unknown execute mode {execute_mode!r}; known: {', '.join(m.name for m in Execute)}")
    return {"execute_fn_name": EXECUTE_FN_NAMES[execute_mode]}


def register_dispatch_mode(name: str, dispatch_fn: DispatchFn, collect_fn: CollectFn) -> Mode:
    """Add a named dispatch mode, usable as ``Dispatch.<name>`` in ``@register``.
    ``ValueError`` when the name is taken or a function is not callable."""
    if not callable(dispatch_fn) or not callable(collect_fn):
        raise ValueError(f"dispatch mode {name!r} needs callable dispatch_fn and collect_fn")
    if name in Dispatch and Dispatch[name] in DISPATCH_TABLE:
        raise ValueError(f"dispatch mode {name!r} is already registered")
    mode = Dispatch.register(name)
    DISPATCH_TABLE[mode] = DispatchSpec.of({"dispatch_fn": dispatch_fn, "collect_fn": collect_fn})
    return mode


def update_dispatch_mode(dispatch_mode: Mode, dispatch_fn: DispatchFn, collect_fn: CollectFn) -> None:
    """Replace the functions of a registered mode (built-in ones too): every group
    dispatches with the new ones from its next call. ``ValueError`` for an unknown mode."""
    _check_dispatch_mode(dispatch_mode)
    if not isinstance(dispatch_mode, Mode) or dispatch_mode not in DISPATCH_TABLE:
        raise ValueError(f"cannot update dispatch mode {dispatch_mode!r}: it is not registered")
    DISPATCH_TABLE[dispatch_mode] = DispatchSpec.of({"dispatch_fn": dispatch_fn, "collect_fn": collect_fn})


def resolve_dispatch_mode(mode: Mode | str | Mapping) -> DispatchSpec:
    """The :class:`DispatchSpec` for a mode, a mode name, or a custom
    ``{'dispatch_fn': ..., 'collect_fn': ...}`` dict; ValueError for anything else."""
    if isinstance(mode, Mapping):
        return DispatchSpec.of(mode)
    if isinstance(mode, str):
        if mode not in Dispatch:
            raise ValueError(f"unknown dispatch mode {mode!r}; known: {', '.join(m.name for m in Dispatch)}")
        mode = Dispatch[mode]
    if not isinstance(mode, Mode) or mode not in DISPATCH_TABLE:
        raise ValueError(
            f"unknown dispatch mode {mode!r}; known: {', '.join(m.name for m in DISPATCH_TABLE)}"
        )
    return DispatchSpec.of(DISPATCH_TABLE[mode])


def dispatch_mode_name(mode: Mode | str | Mapping) -> str:
    """A printable name: the mode's name, ``ND_COMPUTE_PROTO(<mesh>)`` for a mesh's mode
    (``make_nd_compute_dataproto_dispatch_fn``), or ``custom:<dispatch_fn name>``."""
    mesh_mode_name = getattr(mode, "name", None)
    if isinstance(mode, Mapping) and isinstance(mesh_mode_name, str):
        return mesh_mode_name
    if isinstance(mode, Mapping):
        return f"custom:{getattr(mode['dispatch_fn'], '__name__', 'dispatch_fn')}"
    return mode if isinstance(mode, str) else mode.name
