"""Colocated workers: several worker classes in one process per bundle (HybridFlow's
fused workers).

``create_colocated_worker_cls({"actor": RayClassWithInitArgs(A), "critic": ...})``
describes one actor class holding an instance of every role. A ``RayWorkerGroup``
started from it runs one process per bundle; ``group.spawn(prefix_set=...)`` then gives
one group per role, addressed exactly like a group of that class alone, with every
role's calls going to the same processes. Roles share the processes, so they share
their fate too: shutting down (or losing) one process ends it for every role.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from single_controller.base import Worker
from single_controller.base.decorator import MAGIC_ATTR, get_method_spec
from single_controller.base.worker_methods import public_methods, user_class
from single_controller.ray.worker_group import RayClassWithInitArgs

#: The separator between a role and a method in the fused class's method names.
ROLE_SEPARATOR = "_"


class ColocatedClassWithInitArgs(RayClassWithInitArgs):
    """The fused class, and the role classes (with their arguments) it holds."""

    def __init__(self, cls: Any, roles: dict[str, RayClassWithInitArgs]) -> None:
        super().__init__(cls)
        self.roles = dict(roles)

    @staticmethod
    def method_prefix(role: str) -> str:
        """What a role's methods are prefixed with on the fused class."""
        return f"{role}{ROLE_SEPARATOR}"


def _forwarder(role: str, name: str, original: Callable) -> Callable:
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._roles[role], name)(*args, **kwargs)

    forward.__name__ = ColocatedClassWithInitArgs.method_prefix(role) + name
    forward.__doc__ = original.__doc__
    spec = get_method_spec(original)
    if spec is not None:
        setattr(forward, MAGIC_ATTR, spec)
    return forward


def _merged_options(roles: dict[str, RayClassWithInitArgs]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for role, cls_with_init in roles.items():
        for key, value in cls_with_init._options.items():
            if key in merged and merged[key] != value:
                raise ValueError(f"colocated roles disagree on the actor option {key!r} (role {role!r})")
            merged[key] = value
    return merged


def create_colocated_worker_cls(class_dict: dict[str, RayClassWithInitArgs]) -> ColocatedClassWithInitArgs:
    """One actor class holding every role of ``class_dict`` (role name to the role's
    class and constructor arguments). Role ``r``'s method ``m`` is ``r_m`` on the fused
    class, with ``m``'s ``@register`` modes.

    Raises ``ValueError`` for an empty dict, a role name that is not an identifier, a
    role that is not a Worker, or two roles whose names would give the same method.
    """
    if not class_dict:
        raise ValueError("create_colocated_worker_cls needs at least one role")
    roles: dict[str, RayClassWithInitArgs] = {}
    attributes: dict[str, Any] = {}
    for role, cls_with_init in class_dict.items():
        if not isinstance(role, str) or not role.isidentifier() or role.startswith("_"):
            raise ValueError(f"role names must be identifiers without a leading underscore, got {role!r}")
        if not isinstance(cls_with_init, RayClassWithInitArgs):
            raise ValueError(f"role {role!r}: expected a RayClassWithInitArgs, got {type(cls_with_init).__name__}")
        plain = user_class(cls_with_init.cls)
        if not issubclass(plain, Worker):
            raise ValueError(f"role {role!r}: {plain.__name__} is not a Worker subclass")
        for name in public_methods(plain, include_library=True):
            fused_name = ColocatedClassWithInitArgs.method_prefix(role) + name
            if fused_name in attributes:
                raise ValueError(f"roles collide on the fused method name {fused_name!r}")
            attributes[fused_name] = _forwarder(role, name, getattr(plain, name))
        roles[role] = cls_with_init

    role_specs = {
        role: (user_class(c.cls), c.args, c.kwargs) for role, c in roles.items()
    }

    def __init__(self) -> None:
        Worker.__init__(self)
        # Every role reads the same rank environment: they are one rank of one pool.
        self._roles = {role: cls(*args, **kwargs) for role, (cls, args, kwargs) in role_specs.items()}

    attributes["__init__"] = __init__
    attributes["__doc__"] = f"Colocated roles: {', '.join(roles)}."
    name = "Colocated_" + "_".join(user_class(c.cls).__name__ for c in roles.values())
    fused = type(name, (Worker,), attributes)
    fused.__module__ = __name__
    fused.__qualname__ = name
    colocated = ColocatedClassWithInitArgs(ray.remote(fused), roles)
    colocated.update_options(_merged_options(roles))
    return colocated
