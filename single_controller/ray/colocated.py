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

import inspect
from collections.abc import Callable
from typing import Any

import ray

from single_controller.base import Worker
from single_controller.base.decorator import MAGIC_ATTR, get_method_spec
from single_controller.base.worker_methods import public_methods, registered_methods, user_class
from single_controller.ray.class_with_init import RayClassWithInitArgs

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


def role_method_names(plain: type) -> list[str]:
    """The methods a role forwards: its public ones (library ones included, e.g.
    ``init_megatron``) and every registered one (``Worker``'s
    ``execute_with_func_generator`` too, so it runs with the role as ``self``)."""
    return sorted(set(public_methods(plain, include_library=True)) | set(registered_methods(plain)))


def forwarder(role: str, name: str, original: Callable, fused_name: str, keep_spec: bool = True) -> Callable:
    """A method ``fused_name`` of the fused class that calls role ``role``'s ``name``
    (the instance in ``self.fused_worker_dict[role]``). It is ``async`` exactly when the
    original is, and awaits it, so an async role method answers its value, never an
    unawaited coroutine. ``keep_spec`` copies the original's ``@register`` modes."""
    if inspect.iscoroutinefunction(original):

        async def forward(self, *args: Any, **kwargs: Any) -> Any:
            return await getattr(self.fused_worker_dict[role], name)(*args, **kwargs)

    else:

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.fused_worker_dict[role], name)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = fused_name
    forward.__doc__ = original.__doc__
    spec = get_method_spec(original)
    if keep_spec and spec is not None:
        setattr(forward, MAGIC_ATTR, spec)
    return forward


def role_forwarders(
    roles: dict[str, type], fused_name: Callable[[str, str], str], keep_spec: bool = True
) -> dict[str, Callable]:
    """Every role's forwarders by their name on the fused class; ``ValueError`` when two
    roles' methods would get the same name."""
    attributes: dict[str, Callable] = {}
    for role, plain in roles.items():
        for name in role_method_names(plain):
            target = fused_name(role, name)
            if target in attributes:
                raise ValueError(f"roles collide on the fused method name {target!r}")
            attributes[target] = forwarder(role, name, getattr(plain, name), target, keep_spec)
    return attributes


def check_roles(class_dict: dict[str, RayClassWithInitArgs], what: str) -> dict[str, type]:
    """The plain role classes of ``class_dict``; ``ValueError`` for an empty dict, a role
    name that is not an identifier, or a role that is not a Worker."""
    if not class_dict:
        raise ValueError(f"{what} needs at least one role")
    plain_roles: dict[str, type] = {}
    for role, cls_with_init in class_dict.items():
        if not isinstance(role, str) or not role.isidentifier() or role.startswith("_"):
            raise ValueError(f"role names must be identifiers without a leading underscore, got {role!r}")
        if not isinstance(cls_with_init, RayClassWithInitArgs):
            raise ValueError(f"role {role!r}: expected a RayClassWithInitArgs, got {type(cls_with_init).__name__}")
        plain = user_class(cls_with_init.cls)
        if not issubclass(plain, Worker):
            raise ValueError(f"role {role!r}: {plain.__name__} is not a Worker subclass")
        plain_roles[role] = plain
    return plain_roles


def build_roles(owner: Worker, class_dict: dict[str, tuple[type, tuple, dict]]) -> dict[str, Any]:
    """Construct every role in this process (they read the same rank environment: they
    are one rank of one pool) and let each see the others (``fused_worker_dict``)."""
    roles = {role: cls(*args, **kwargs) for role, (cls, args, kwargs) in class_dict.items()}
    owner.fused_worker_dict = roles
    for instance in roles.values():
        setattr(instance, Worker.fused_worker_attr_name, roles)
    return roles


def select_roles(prefix_set: Any, roles: dict[str, Any], holder: str) -> list[str]:
    """The roles ``prefix_set`` names, in its order; ``ValueError`` naming unknown ones."""
    wanted = list(prefix_set)
    unknown = [role for role in wanted if role not in roles]
    if unknown:
        raise ValueError(f"unknown roles {unknown}; this {holder} holds {sorted(roles)}")
    return wanted


def worker_class(name: str, attributes: dict[str, Any], module: str) -> type:
    """A ``Worker`` subclass built from ``attributes``, named ``name`` in ``module`` (Ray
    pickles it by value: it is not reachable by that name in the module)."""
    cls = type(name, (Worker,), attributes)
    cls.__module__ = module
    cls.__qualname__ = name
    return cls


def merged_options(roles: dict[str, RayClassWithInitArgs]) -> dict[str, Any]:
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
    plain_roles = check_roles(class_dict, "create_colocated_worker_cls")
    attributes: dict[str, Any] = role_forwarders(
        plain_roles, lambda role, name: ColocatedClassWithInitArgs.method_prefix(role) + name
    )
    role_specs = {role: (plain_roles[role], c.args, c.kwargs) for role, c in class_dict.items()}

    def __init__(self) -> None:
        Worker.__init__(self)
        build_roles(self, role_specs)

    attributes["__init__"] = __init__
    attributes["__doc__"] = f"Colocated roles: {', '.join(class_dict)}."
    name = "Colocated_" + "_".join(cls.__name__ for cls in plain_roles.values())
    fused = worker_class(name, attributes, __name__)
    colocated = ColocatedClassWithInitArgs(ray.remote(fused), dict(class_dict))
    colocated.update_options(merged_options(class_dict))
    return colocated


def spawn_colocated_roles(group: Any, prefix_set: Any) -> dict[str, Any]:
    """``group.spawn(prefix_set)`` for a group of a ``create_colocated_worker_cls`` class."""
    roles = getattr(group.ray_cls_with_init, "roles", None)
    if roles is None:
        raise ValueError("spawn needs a group started from create_colocated_worker_cls(...)")
    prefix = ColocatedClassWithInitArgs.method_prefix
    return {role: group.role_view(prefix(role), roles[role]) for role in select_roles(prefix_set, roles, "group")}
