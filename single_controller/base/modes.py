"""The named dispatch and execute modes.

Modes are open sets: ``Dispatch.register(name)`` (through
:func:`single_controller.base.decorator.register_dispatch_mode`) adds one at run
time, which a plain :class:`enum.Enum` cannot do. A mode compares and pickles by
name, so a mode attached to a worker method means the same thing on every process.
"""

from __future__ import annotations

from collections.abc import Iterator


class Mode:
    """One named mode of a :class:`ModeRegistry` (``Dispatch.ONE_TO_ALL``)."""

    __slots__ = ("kind", "name")

    def __init__(self, kind: str, name: str) -> None:
        self.kind = kind
        self.name = name

    @property
    def value(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"{self.kind}.{self.name}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mode) and (other.kind, other.name) == (self.kind, self.name)

    def __hash__(self) -> int:
        return hash((self.kind, self.name))

    def __reduce__(self):
        return (_restore_mode, (self.kind, self.name))


def _restore_mode(kind: str, name: str) -> Mode:
    registry = _REGISTRIES[kind]
    return registry._members.get(name) or Mode(kind, name)


class ModeRegistry(type):
    """Metaclass giving ``Dispatch['ONE_TO_ALL']``, ``in`` and iteration over members."""

    _members: dict[str, Mode]
    _aliases: dict[str, str]

    def __getitem__(cls, name: str) -> Mode:
        key = cls._aliases.get(name, name)
        try:
            return cls._members[key]
        except KeyError:
            known = ", ".join(cls._members)
            raise KeyError(f"unknown {cls.__name__} mode {name!r}; known: {known}") from None

    def __iter__(cls) -> Iterator[Mode]:
        return iter(list(cls._members.values()))

    def __contains__(cls, item: object) -> bool:
        if isinstance(item, Mode):
            return item.kind == cls.__name__ and item.name in cls._members
        return isinstance(item, str) and cls._aliases.get(item, item) in cls._members

    def __len__(cls) -> int:
        return len(cls._members)

    def register(cls, name: str) -> Mode:
        """Add (or return the existing) mode ``name``, reachable as ``cls.<name>``."""
        if not name.isidentifier():
            raise ValueError(f"a {cls.__name__} mode name must be an identifier, got {name!r}")
        if name not in cls._members:
            mode = Mode(cls.__name__, name)
            cls._members[name] = mode
            setattr(cls, name, mode)
        return cls._members[name]

    def alias(cls, alias: str, name: str) -> None:
        cls._aliases[alias] = name

    def remove(cls, name: str) -> Mode:
        """Take mode ``name`` (or an alias of it) out of the set, with its aliases, and
        return it (verl's ``Dispatch.remove``). What a mode maps to elsewhere (the
        dispatch table) is left to its owner. ``ValueError`` for an unknown name."""
        key = cls._aliases.get(name, name)
        if key not in cls._members:
            known = ", ".join(cls._members)
            raise ValueError(f"cannot remove {cls.__name__} mode {name!r}: not registered; known: {known}")
        mode = cls._members.pop(key)
        delattr(cls, key)
        for alias in [a for a, target in cls._aliases.items() if target == key]:
            del cls._aliases[alias]
        return mode


class Dispatch(metaclass=ModeRegistry):
    """How a call's arguments are split across ranks and how outputs are collected."""

    _members: dict[str, Mode] = {}
    _aliases: dict[str, str] = {}


class Execute(metaclass=ModeRegistry):
    """Which ranks execute a call: every rank (ALL) or rank 0 only (RANK_ZERO)."""

    _members: dict[str, Mode] = {}
    _aliases: dict[str, str] = {}


_REGISTRIES: dict[str, ModeRegistry] = {"Dispatch": Dispatch, "Execute": Execute}

for _name in (
    "RANK_ZERO",
    "ONE_TO_ALL",
    "ALL_TO_ALL",
    "MEGATRON_COMPUTE",
    "MEGATRON_PP_AS_DP",
    "MEGATRON_PP_ONLY",
    "MEGATRON_COMPUTE_PROTO",
    "MEGATRON_PP_AS_DP_PROTO",
    "DP_COMPUTE",
    "DP_COMPUTE_PROTO",
    "ALL_MICRO_DP",
    # verl v0.4's additions: a function and a batch, per-rank metrics from a batch,
    # and the rollout-only mode that a group never dispatches itself.
    "DP_COMPUTE_PROTO_WITH_FUNC",
    "DP_COMPUTE_METRIC",
    "DIRECT_ROLLOUT_METHOD",
):
    Dispatch.register(_name)
# The HybridFlow paper's names for the same transfer protocols.
Dispatch.alias("3D_PROTO", "MEGATRON_COMPUTE_PROTO")
Dispatch.alias("3D_PP_ONLY", "MEGATRON_PP_ONLY")
Dispatch.alias("3D_ALL_MICRO_DP", "ALL_MICRO_DP")
Dispatch.alias("DP_PROTO", "DP_COMPUTE_PROTO")

Execute.register("ALL")
Execute.register("RANK_ZERO")
