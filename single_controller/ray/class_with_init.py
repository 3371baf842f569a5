"""A worker class and its constructor arguments, and how one actor of it is started in a
placement group's bundle."""

from __future__ import annotations

from typing import Any

from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from single_controller.base.worker_group import ClassWithInitArgs
from single_controller.ray.rank_env import RANK_ENV_KWARG, TENSORS_OUT_OF_BAND_ENV, with_rank_env

__all__ = ["RayClassWithInitArgs"]


class RayClassWithInitArgs(ClassWithInitArgs):
    """A worker class (plain or ``@ray.remote``) and its constructor arguments."""

    def __init__(self, cls: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(cls, *args, **kwargs)
        self._options: dict[str, Any] = {}
        self._additional_resource: dict[str, float] = {}
        self._rank_env: dict[str, str] = {}

    def update_options(self, options: dict[str, Any]) -> None:
        """Extra ``.options()`` for every actor (runtime_env, max_concurrency, ...)."""
        self._options.update(options)

    def set_additional_resource(self, additional_resource: dict[str, float]) -> None:
        self._additional_resource = dict(additional_resource)

    def send_tensors_out_of_band(self) -> None:
        """Every actor made from this sends plain CPU tensors to Ray as numpy buffers out
        of band, its return values included (``tensor_transport``; set through the rank's
        environment, so no runtime_env is needed). An actor whose class's module does not
        load torch is left as it is: it stays torch-free."""
        self._rank_env[TENSORS_OUT_OF_BAND_ENV] = "1"

    def __call__(
        self,
        placement_group: Any,
        placement_group_bundle_idx: int,
        use_gpu: bool = True,
        num_gpus: float = 1,
        num_cpus: float | None = None,
        env_vars: dict[str, str] | None = None,
        name: str | None = None,
        detached: bool = False,
    ) -> Any:
        options: dict[str, Any] = {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=placement_group,
                placement_group_bundle_index=placement_group_bundle_idx,
            ),
        }
        options.update(self._options)
        options["num_gpus"] = num_gpus if use_gpu else 0
        if num_cpus is not None:
            options["num_cpus"] = num_cpus
        if self._additional_resource:
            options["resources"] = dict(self._additional_resource)
        if name:
            options["name"] = name
        if detached:
            options["lifetime"] = "detached"
        # The rank's variables go through the constructor, not a runtime_env (rank_env.py).
        actor_cls = with_rank_env(self.cls)
        rank_env = {**self._rank_env, **(env_vars or {})}
        return actor_cls.options(**options).remote(*self.args, **self.kwargs, **{RANK_ENV_KWARG: rank_env})
