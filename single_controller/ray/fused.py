"""Fused workers (verl v0.4): several worker classes in one process, written as one class.

``create_colocated_worker_raw_cls({"actor": RayClassWithInitArgs(Actor), "critic": ...})``
returns a plain ``Worker`` subclass whose instances hold one instance of every role, as
``self.actor``, ``self.critic`` and ``self.fused_worker_dict``; each role sees the others
through its own ``fused_worker_dict``. Subclass it to add methods that use several roles
in one call, decorate the subclass with ``@ray.remote``, and mark its
``RayClassWithInitArgs`` with ``fused_worker_used = True``
(``create_colocated_worker_cls_fused`` does all of that for the plain fused class).

A group of such a class binds the class's own registered methods. Its roles are reached
with ``group.spawn(prefix_set)`` / ``spawn_fused`` (one group per role) or
``group.fuse(prefix_set)`` (then ``group.actor.add(x)``). Role ``r``'s method ``m`` is the
fused class's ``r_fwmn_m`` (verl's "fused worker method name"), and
``_fuw_execute("r_fwmn_m", ...)`` calls it by name, as in verl. A role's ``async``
methods are awaited there, so they answer values.
"""

from __future__ import annotations

import inspect
from typing import Any

import ray

from single_controller.base import Worker
from single_controller.base.worker_methods import user_class
from single_controller.ray.class_with_init import RayClassWithInitArgs
from single_controller.ray.colocated import (
    build_roles,
    check_roles,
    merged_options,
    role_forwarders,
    select_roles,
    worker_class,
)

#: The fused class's name starts with this, then the role names (verl's naming).
FUSED_WORKER_CLS_NAME = "FusedWorker"
#: Between a role and its method in the fused class's method names.
FUSED_METHOD_SEPARATOR = "_fwmn_"


def fused_method_name(role: str, method: str) -> str:
    """The fused class's name for role ``role``'s method ``method``."""
    return f"{role}{FUSED_METHOD_SEPARATOR}{method}"


def _fused_executor(is_async: bool):
    def target(self: Any, method_name: str) -> Any:
        role, sep, method = method_name.partition(FUSED_METHOD_SEPARATOR)
        if not sep or role not in self.fused_worker_dict:
            raise ValueError(
                f"_fuw_execute takes '<role>{FUSED_METHOD_SEPARATOR}<method>' with a role of "
                f"{sorted(self.fused_worker_dict)}, got {method_name!r}"
            )
        return getattr(self.fused_worker_dict[role], method)

    if is_async:

        async def _fuw_execute(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
            result = target(self, method_name)(*args, **kwargs)
            return await result if inspect.isawaitable(result) else result

    else:

        def _fuw_execute(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
            return target(self, method_name)(*args, **kwargs)

    _fuw_execute.__doc__ = "Call a role's method by its fused name, '<role>_fwmn_<method>' (verl's entry point)."
    return _fuw_execute


def create_colocated_worker_raw_cls(class_dict: dict[str, RayClassWithInitArgs]) -> type:
    """The plain fused class of ``class_dict`` (role name to class and arguments): a
    ``Worker`` subclass to extend and decorate with ``@ray.remote``.

    ``ValueError`` for an empty dict, a role name that is not an identifier or that
    would hide a Worker attribute, or a role class that is not a Worker."""
    plain_roles = check_roles(class_dict, "create_colocated_worker_raw_cls")
    hidden = sorted(role for role in plain_roles if hasattr(Worker, role))
    if hidden:
        raise ValueError(f"role names {hidden} would hide Worker attributes of the same name")
    role_specs = {role: (plain_roles[role], c.args, c.kwargs) for role, c in class_dict.items()}
    attributes: dict[str, Any] = role_forwarders(plain_roles, fused_method_name, keep_spec=False)
    is_async = any(inspect.iscoroutinefunction(f) for f in attributes.values())

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        Worker.__init__(self, *args, **kwargs)
        for role, instance in build_roles(self, role_specs).items():
            setattr(self, role, instance)

    name = "_".join([FUSED_WORKER_CLS_NAME, *plain_roles])
    attributes.update(
        __init__=__init__,
        __doc__=f"Fused roles: {', '.join(plain_roles)}.",
        _fuw_execute=_fused_executor(is_async),
        is_fused_worker=True,
        raw_cls_dict=dict(plain_roles),
    )
    return worker_class(name, attributes, __name__)


def create_colocated_worker_cls_fused(class_dict: dict[str, RayClassWithInitArgs]) -> RayClassWithInitArgs:
    """``create_colocated_worker_raw_cls(class_dict)`` as a Ray actor class, marked
    ``fused_worker_used``: a group of it spawns one group per role."""
    raw = create_colocated_worker_raw_cls(class_dict)
    fused = RayClassWithInitArgs(ray.remote(raw))
    fused.fused_worker_used = True
    fused.update_options(merged_options(class_dict))
    return fused


def _raw_roles(group: Any) -> dict[str, type]:
    cls = group.ray_cls_with_init.cls if group.ray_cls_with_init is not None else None
    roles = getattr(user_class(cls), "raw_cls_dict", None)
    if not roles:
        raise ValueError("spawn_fused needs a group of a fused worker class (create_colocated_worker_cls_fused)")
    return roles


def spawn_fused_roles(group: Any, prefix_set: Any) -> dict[str, Any]:
    """One group per role in ``prefix_set``, each binding that role's registered methods
    and calling them on the fused processes."""
    roles = _raw_roles(group)
    views = {}
    for role in select_roles(prefix_set, roles, "fused worker"):
        view = group.role_view(fused_method_name(role, ""), RayClassWithInitArgs(roles[role]))
        view.sub_cls_name = role
        views[role] = view
    return views


def fuse_roles(group: Any, prefix_set: Any) -> None:
    """Make every role's group an attribute of ``group`` (``group.actor``)."""
    if group.wg_dict is None:
        group.wg_dict = group.spawn(prefix_set)
    for role, role_group in group.wg_dict.items():
        taken = hasattr(type(group), role) or role in group.method_specs
        if taken or group.__dict__.get(role, role_group) is not role_group:
            raise ValueError(f"fuse: role {role!r} would hide the group's own attribute {role!r}")
        setattr(group, role, role_group)
