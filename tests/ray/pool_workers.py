"""Worker classes that never load torch (their processes start faster), for tests about
where ranks are placed and what they see."""

from __future__ import annotations

import os

import ray

from single_controller.base import Worker
from single_controller.base.decorator import Dispatch, register


class EnvReader(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def env(self, key: str) -> str | None:
        return os.environ.get(key)


RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "WG_BACKEND")


@ray.remote(max_concurrency=3)
class InitEnvReader(Worker):
    """What the rank's variables were while its ``__init__`` ran, and its runtime env."""

    def __init__(self, tag):
        super().__init__()
        self.in_init = (tag, self.rank, {k: os.environ.get(k) for k in RANK_VARIABLES})

    def seen(self):
        return self.in_init, ray.get_runtime_context().get_runtime_env_string()


class PlainEnvReader:
    """Not a Worker: it reads the rank's variables from the environment alone."""

    def __init__(self):
        self.rank = int(os.environ["RANK"])

    def seen(self):
        return self.rank
