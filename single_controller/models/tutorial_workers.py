"""The tutorial's worker classes, on the device this process has (cuda, else cpu).

``GPUAccumulator`` and ``GPUAccumulatorDecorator`` also answer ``get_value``. The
service's test actor (``examples.transport_check``) extends ``TestActor`` with the
checks the service's tests need.

Every class here has ``state_dict()`` and ``load_state_dict(state)`` (torch's
convention): the service snapshots a group with them, so a rebuilt group loads its
state instead of replaying every call since the start.
"""

from __future__ import annotations

import ray
import torch

from single_controller.base import Worker
from single_controller.base.decorator import Dispatch, Execute, collect_all_to_all, register
from single_controller.device import get_device_name


@ray.remote
class Accumulator:
    """Chapter 1: a plain Ray actor."""

    def __init__(self) -> None:
        self.value = 0

    def add(self, x):
        self.value += x

    def get_value(self):
        return self.value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


class _TensorValue:
    """``state_dict``/``load_state_dict`` of a worker whose state is ``self.value``, a
    tensor on this process's device."""

    def state_dict(self):
        return {"value": self.value.cpu()}

    def load_state_dict(self, state):
        self.value = state["value"].to(get_device_name(), copy=True)


@ray.remote
class GPUAccumulator(_TensorValue, Worker):
    """Chapter 2: each rank starts at its rank; ``add`` is called through execute_all."""

    def __init__(self) -> None:
        super().__init__()
        self.value = torch.zeros(size=(1,), device=get_device_name()) + self.rank

    def add(self, x):
        self.value += x
        return self.value.cpu()

    def get_value(self):
        return self.value.cpu()


@ray.remote
class GPUAccumulatorDecorator(_TensorValue, Worker):
    """Chapter 3: ``add`` registered ONE_TO_ALL, so one value reaches every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.value = torch.zeros(size=(1,), device=get_device_name()) + self.rank

    @register(Dispatch.ONE_TO_ALL)
    def add(self, x):
        self.value = self.value + x
        return self.value.cpu()

    @register(Dispatch.ONE_TO_ALL)
    def get_value(self):
        return self.value.cpu()


def two_to_all_dispatch_fn(worker_group, *args, **kwargs):
    """The tutorial's custom dispatch: two inputs, repeated interleaved over the ranks."""
    for arg in args:
        assert len(arg) == 2
        for i in range(worker_group.world_size - 2):
            arg.append(arg[i % 2])
    for _key, value in kwargs.items():
        assert len(value) == 2
        for i in range(worker_group.world_size - 2):
            value.append(value[i % 2])
    return args, kwargs


@ray.remote
class TestActor(Worker):
    """Chapter 3's custom dispatch and rank-zero execution."""

    __test__ = False  # not a pytest class

    def __init__(self, x) -> None:
        super().__init__()
        self._x = x

    def foo(self, y):
        return self._x + y

    def state_dict(self):
        return {"x": self._x}

    def load_state_dict(self, state):
        self._x = state["x"]

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def foo_rank_zero(self, x, y):
        return self._x + y + x

    @register(dispatch_mode={"dispatch_fn": two_to_all_dispatch_fn, "collect_fn": collect_all_to_all})
    def foo_custom(self, x, y):
        return self._x + y + x
