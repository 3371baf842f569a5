"""A worker class that never loads torch (its processes start faster), for tests about
where ranks are placed and what they see."""

from __future__ import annotations

import os

from single_controller.base import Worker
from single_controller.base.decorator import Dispatch, register


class EnvReader(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def env(self, key: str) -> str | None:
        return os.environ.get(key)
