"""Loading the serve config's ``args``: pydantic checks the shape, then the checks it
cannot make (names that refer to other names, worker classes that import and are
Workers, models whose method exists), each problem named by its path."""

from __future__ import annotations

import importlib
from typing import Any

from pydantic import ValidationError

from hybridflow.config.environment import setting
from hybridflow.config.groups import RESERVED_DEPLOYMENTS, ConfigError, DeploymentConfig, GroupConfig
from hybridflow.config.service import ServiceConfig


def import_worker(path: str) -> Any:
    """The object ``module:Qualified.Name`` names; ImportError/AttributeError as they come."""
    module_name, _, qualname = path.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _where(loc: tuple, document: Any) -> str:
    """A pydantic location as a config path, list items named by their ``name``."""
    parts: list[str] = []
    node = document
    for key in loc:
        if isinstance(key, int) and isinstance(node, list):
            item = node[key] if key < len(node) else None
            name = item.get("name") if isinstance(item, dict) else None
            parts[-1] += f"[{name}]" if isinstance(name, str) else f"[{key}]"
            node = item
        else:
            parts.append(str(key))
            node = node.get(key) if isinstance(node, dict) else None
    return ".".join(parts) or "args"


def load_config(args: dict[str, Any] | None, check_workers: bool = True) -> ServiceConfig:
    """Validate the serve config's ``args``; :class:`ConfigError` names every problem.

    ``check_workers`` imports each worker class to check that it is a Worker (or any
    class for a plain actor) and that read-only methods, init calls and models name
    methods it has.
    """
    document = dict(args or {})
    try:
        config = ServiceConfig.model_validate(document)
    except ValidationError as exc:
        problems = [f"{_where(err['loc'], document)}: {err['msg']}" for err in exc.errors()]
        raise ConfigError("invalid serve config:\n  " + "\n  ".join(problems)) from None
    token = setting("HYBRIDFLOW_TOKEN")
    if token:
        config.auth_token = token
    problems = _references(config)
    if check_workers and not problems:
        problems = _workers(config)
    if problems:
        raise ConfigError("invalid serve config:\n  " + "\n  ".join(problems))
    return config


def _group_path(deployment: DeploymentConfig, group: GroupConfig) -> str:
    return f"deployments[{deployment.name}].groups[{group.name}]"


def _duplicates(names: list[str]) -> list[str]:
    seen: set[str] = set()
    return sorted({n for n in names if n in seen or seen.add(n)})


def _references(config: ServiceConfig) -> list[str]:
    problems: list[str] = []
    deployment_names = [d.name for d in config.deployments]
    for name in _duplicates(deployment_names):
        problems.append(f"deployments[{name}].name: duplicate deployment name {name!r}")
    for name in sorted(RESERVED_DEPLOYMENTS & set(deployment_names)):
        problems.append(f"deployments[{name}].name: {name!r} is the application's own deployment; pick another")
    # Group and model names are routes (/v1/groups/{g}, /v2/models/{m}): unique service-wide.
    for name in _duplicates([g.name for _, g in config.groups()]):
        problems.append(f"groups[{name}].name: duplicate group name {name!r} (group names are unique service-wide)")
    for name in _duplicates([m.name for _, m in config.models()]):
        problems.append(f"models[{name}].name: duplicate model name {name!r}")
    for deployment in config.deployments:
        groups = {g.name: g for g in deployment.groups}
        for group in deployment.groups:
            path = _group_path(deployment, group)
            problems += _pool_references(path, group, groups)
            for other in group.colocate_with:
                if other == group.name:
                    problems.append(f"{path}.colocate_with: a group cannot colocate with itself")
                elif other not in groups:
                    problems.append(f"{path}.colocate_with: unknown group {other!r} in deployment {deployment.name!r}")
        if not problems:
            problems += _colocation_pools(deployment)
            problems += _weights_sources(deployment)
            problems += _transports(deployment)
            problems += _supervision(deployment)
        for model in deployment.models:
            if model.group not in groups:
                problems.append(
                    f"deployments[{deployment.name}].models[{model.name}].group: unknown group {model.group!r}; "
                    f"groups of this deployment: {', '.join(groups)}"
                )
    return problems


def _pool_references(path: str, group: GroupConfig, groups: dict[str, GroupConfig]) -> list[str]:
    if group.pool is None:
        return []
    problems = []
    refs = [("same_as", group.pool.same_as)] if group.pool.same_as else []
    refs += [("merge", name) for name in group.pool.merge or []]
    for field_name, ref in refs:
        target = groups.get(ref)
        if target is None:
            problems.append(f"{path}.pool.{field_name}: unknown group {ref!r} in this deployment")
        elif ref == group.name:
            problems.append(f"{path}.pool.{field_name}: a group cannot refer to its own pool")
        elif target.pool is None:
            problems.append(f"{path}.pool.{field_name}: group {ref!r} is a plain actor and has no pool")
    if not problems:
        try:
            pool_root(group.name, groups)
        except ValueError as exc:
            problems.append(f"{path}.pool: {exc}")
    return problems


def pool_root(name: str, groups: dict[str, GroupConfig]) -> tuple[str, ...]:
    """The pools a group's pool is made of: ``(own,)`` for a pool of its own or one
    shared through ``same_as``, the merged pools' roots in order for a merge. ValueError
    for a cycle of references."""
    seen: list[str] = []

    def walk(current: str) -> tuple[str, ...]:
        if current in seen:
            raise ValueError(f"pool references form a cycle: {' -> '.join([*seen, current])}")
        seen.append(current)
        pool = groups[current].pool
        if pool.same_as is not None:
            result = walk(pool.same_as)
        elif pool.merge is not None:
            result = tuple(root for part in pool.merge for root in walk(part))
        else:
            result = (current,)
        seen.pop()
        return result

    return walk(name)


def colocations(deployment: DeploymentConfig) -> list[list[str]]:
    """Sets of groups that share processes (``colocate_with`` both ways, transitively),
    each in declaration order; groups not colocated are left out."""
    links: dict[str, set[str]] = {g.name: set() for g in deployment.groups}
    for group in deployment.groups:
        for other in group.colocate_with:
            links[group.name].add(other)
            links[other].add(group.name)
    order = [g.name for g in deployment.groups]
    found, done = [], set()
    for name in order:
        if name in done or not links[name]:
            continue
        component, stack = set(), [name]
        while stack:
            current = stack.pop()
            if current not in component:
                component.add(current)
                stack.extend(links[current])
        done |= component
        found.append([n for n in order if n in component])
    return found


def _colocation_pools(deployment: DeploymentConfig) -> list[str]:
    groups = {g.name: g for g in deployment.groups}
    problems = []
    for members in colocations(deployment):
        roots = {name: pool_root(name, groups) for name in members}
        if len(set(roots.values())) > 1:
            described = ", ".join(f"{name} on {'+'.join(root)}" for name, root in roots.items())
            problems.append(
                f"deployments[{deployment.name}].groups[{members[0]}].colocate_with: colocated groups must share "
                f"one pool (same_as, or the same merge), got {described}"
            )
    return problems


def _weights_sources(deployment: DeploymentConfig) -> list[str]:
    """``weights_from`` names another group of the same deployment, on processes of its own
    (a weight sync runs between two groups of one controller)."""
    groups = {g.name: g for g in deployment.groups}
    colocated = {name for members in colocations(deployment) for name in members}
    problems = []
    for group in deployment.groups:
        source = group.weights_from
        if source is None:
            continue
        where = f"{_group_path(deployment, group)}.weights_from"
        if source == group.name:
            problems.append(f"{where}: a group cannot take its weights from itself")
        elif source not in groups:
            problems.append(
                f"{where}: unknown group {source!r} in deployment {deployment.name!r} (a weight sync runs between "
                f"groups of one deployment); groups of this deployment: {', '.join(groups)}"
            )
        elif groups[source].plain_actor or source in colocated or group.name in colocated:
            problems.append(f"{where}: weight syncs need groups on processes of their own (no plain actor, "
                            f"no colocation); {source!r} or {group.name!r} is not")
    return problems


def channel_unfit(group: GroupConfig, deployment: DeploymentConfig) -> str | None:
    """Why ``group`` cannot take its calls over a channel, a socket channel or a compiled
    graph (None: it can). A channel's calls run beside the ranks' ordinary tasks, so every
    call that touches their state must go through it: a plain actor has no channel step,
    colocated groups share processes with other groups' calls, and a weight sync reads and
    writes the ranks outside it."""
    if group.plain_actor:
        return "a plain actor has no channel step (it is not a Worker)"
    if any(group.name in members for members in colocations(deployment)):
        return "its processes are shared with colocated groups"
    if group.weights_from is not None or any(g.weights_from == group.name for g in deployment.groups):
        return "it takes part in a weight sync, which reaches its ranks outside the channel"
    return None


def _transports(deployment: DeploymentConfig) -> list[str]:
    problems = []
    for group in deployment.groups:
        why = channel_unfit(group, deployment) if group.transport in ("compiled", "socket") else None
        if why is not None:
            problems.append(f"{_group_path(deployment, group)}.transport: {group.transport} is refused: {why}")
    return problems


def replacement_unfit(group: GroupConfig, deployment: DeploymentConfig) -> str | None:
    """Why one of ``group``'s ranks cannot be replaced alone (``on_rank_lost: replace_rank``;
    None: it can), as far as the declaration says; the worker class is checked on import."""
    if group.plain_actor:
        return "a plain actor is a group of one on no pool: there is no rank to replace alone"
    if group.megatron is not None:
        return "a Megatron group's ranks share process groups, which one new rank cannot join alone"
    if any(group.name in members for members in colocations(deployment)):
        return "its processes are shared with colocated groups"
    if group.pool is not None and group.pool.merge is not None:
        return "its processes are on merged pools"
    if group.weights_from is not None or any(g.weights_from == group.name for g in deployment.groups):
        return "it takes part in a weight sync, which moves weights between all ranks of both groups"
    return None


def _supervision(deployment: DeploymentConfig) -> list[str]:
    problems = []
    for group in deployment.groups:
        why = replacement_unfit(group, deployment) if group.supervision.on_rank_lost == "replace_rank" else None
        if why is not None:
            problems.append(f"{_group_path(deployment, group)}.supervision.on_rank_lost: replace_rank is refused: "
                            f"{why}; use rebuild_group or halt")
    groups = {g.name: g for g in deployment.groups}
    for members in colocations(deployment):  # they start and fail together: one supervision
        if len({groups[name].supervision.model_dump_json() for name in members}) > 1:
            problems.append(f"deployments[{deployment.name}].groups[{members[0]}].supervision: colocated groups "
                            f"start and fail together and need the same supervision: {', '.join(members)}")
    return problems


def _workers(config: ServiceConfig) -> list[str]:
    from single_controller.base.worker import Worker
    from single_controller.base.worker_methods import user_class
    from single_controller.megatron.worker import MegatronWorker
    from single_controller.weights.worker import WeightSyncWorker

    problems = []
    for deployment in config.deployments:
        classes: dict[str, type] = {}
        for group in deployment.groups:
            path = _group_path(deployment, group)
            try:
                target = import_worker(group.worker)
            except Exception as exc:  # any error importing user code is a config problem
                problems.append(f"{path}.worker: cannot import {group.worker!r}: {type(exc).__name__}: {exc}")
                continue
            plain = user_class(target)
            if not isinstance(plain, type):
                problems.append(f"{path}.worker: {group.worker!r} is a {type(target).__name__}, not a class")
                continue
            if not group.plain_actor and not issubclass(plain, Worker):
                problems.append(
                    f"{path}.worker: {plain.__name__} is not a Worker subclass "
                    "(subclass single_controller.base.Worker, or declare plain_actor: true)"
                )
                continue
            if group.megatron is not None and not issubclass(plain, MegatronWorker):
                problems.append(f"{path}.worker: a megatron group needs a MegatronWorker subclass, got {plain.__name__}")
                continue
            classes[group.name] = plain
            if group.supervision.on_rank_lost == "replace_rank" and not all(
                    callable(getattr(plain, name, None)) for name in ("state_dict", "load_state_dict")):
                problems.append(f"{path}.supervision.on_rank_lost: replace_rank is refused: {plain.__name__} has no "
                                "state_dict() and load_state_dict() to restore the replaced rank with; use "
                                "rebuild_group or halt")
            for name in group.read_only:
                if not callable(getattr(plain, name, None)):
                    problems.append(f"{path}.read_only: {plain.__name__} has no method {name!r}")
            for call in group.init_calls:
                if not callable(getattr(plain, call.method, None)):
                    problems.append(f"{path}.init_calls: {plain.__name__} has no method {call.method!r}")
        for group in deployment.groups:
            for name in (group.name, group.weights_from) if group.weights_from else ():
                plain = classes.get(name)
                if plain is not None and not issubclass(plain, WeightSyncWorker):
                    problems.append(
                        f"{_group_path(deployment, group)}.weights_from: group {name!r}'s worker {plain.__name__} "
                        "declares no weights (it does not mix in single_controller.weights.WeightSyncWorker)"
                    )
        for model in deployment.models:
            plain = classes.get(model.group)
            where = f"deployments[{deployment.name}].models[{model.name}]"
            if plain is None:
                continue
            for field_name in ("method", "io_method"):
                name = getattr(model, field_name)
                if name is not None and not callable(getattr(plain, name, None)):
                    problems.append(f"{where}.{field_name}: {plain.__name__} has no method {name!r}")
    return problems
