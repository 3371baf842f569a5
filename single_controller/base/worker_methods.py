"""What a worker class offers: its ``@register``-ed methods and its public methods.

This is the one definition of "a method a caller may call on a worker group": the
colocated-role forwarders and the service's method catalogue both read it.
"""

from __future__ import annotations

import inspect
from typing import Any

from single_controller.base.decorator import MethodSpec, get_method_spec

#: Modules whose worker base classes are the library's plumbing (Worker, MegatronWorker):
#: their methods run the group, they are not a worker's own API.
LIBRARY_BASE_MODULES = ("single_controller.base.", "single_controller.megatron.")


def user_class(cls: Any) -> type:
    """The plain Python class behind a ``@ray.remote`` actor class (or ``cls`` itself)."""
    return getattr(cls, "__ray_actor_class__", cls)


def registered_methods(cls: Any) -> dict[str, MethodSpec]:
    """Every ``@register``-ed method of a worker class (inherited ones too)."""
    found: dict[str, MethodSpec] = {}
    for name, member in inspect.getmembers(user_class(cls)):
        spec = get_method_spec(member)
        if spec is not None:
            found[name] = spec
    return found


def _library_method_names(plain: type) -> set[str]:
    names = set(dir(object))
    for base in inspect.getmro(plain):
        if base.__module__.startswith(LIBRARY_BASE_MODULES) or base.__module__ == "builtins":
            names |= set(vars(base))
    return names


def public_methods(cls: Any, include_library: bool = False) -> list[str]:
    """Public methods of a worker class, in name order: its own and inherited ones, with
    no leading underscore, and none of the library base classes' (``Worker``,
    ``MegatronWorker``) unless ``include_library`` (colocated roles forward those too,
    since the group calls them, e.g. ``init_megatron``). ``Worker``'s own methods are
    never listed: every process has them already."""
    plain = user_class(cls)
    from single_controller.base.worker import Worker

    hidden = set(dir(Worker)) if include_library else _library_method_names(plain)
    return [
        name
        for name, _ in inspect.getmembers(plain, predicate=inspect.isfunction)
        if not name.startswith("_") and name not in hidden
    ]
