"""The hand-written floor for the service's calls: one process, FastAPI under uvicorn,
holding the Ray actor handles of a group's ranks (the same worker class and rank count as
the service's ``gpu_accumulator_decorator``), answering ``POST /add`` with an
``asyncio.gather`` of the rank calls, JSON out. What a user who wants speed writes by hand.

    python -m bench.floor_app --port 8123 [--ranks 8]

Also the cold-start floor: :func:`start_ranks` starts a given set of worker classes, one
process each, with the same imports as the service's ranks (megatron.core for a Megatron
rank), in one script, and answers when every one answered.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

from pydantic import BaseModel

#: The worker class of the figure's group, as serve_config.yaml names it.
WORKER = "single_controller.models.tutorial_workers:GPUAccumulatorDecorator"


def import_class(path: str) -> Any:
    import importlib

    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def rank_actors(worker: str, ranks: int, num_cpus: float = 0.05) -> list[Any]:
    """``ranks`` actors of ``worker``, each told its rank as a worker group would."""
    import ray

    cls = import_class(worker)
    if not hasattr(cls, "remote"):  # the tutorial's classes are @ray.remote already
        cls = ray.remote(cls)
    actors = []
    for rank in range(ranks):
        env = {"RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(ranks),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
        actors.append(cls.options(num_cpus=num_cpus, runtime_env={"env_vars": env}).remote())
    return actors


#: What a Megatron rank's construction imports beyond its class's module: the rank sets up
#: megatron's process groups and builds its layer from megatron.core's parallel layers.
MEGATRON_RANK_IMPORTS = ("megatron.core.parallel_state", "megatron.core.tensor_parallel")


def rank_imports(cls: Any) -> tuple[str, ...]:
    """The modules a rank of ``cls`` holds once it is up, beyond the class's own module:
    megatron.core for a Megatron worker (the tutorial's ``@ray.remote`` classes are looked
    through to the class they wrap)."""
    from single_controller.base.worker_methods import user_class
    from single_controller.megatron.worker import MegatronWorker

    return MEGATRON_RANK_IMPORTS if issubclass(user_class(cls), MegatronWorker) else ()


def _importer() -> Any:
    import ray

    @ray.remote
    class Importer:
        """A rank process that imports what a rank of its worker class imports (the
        class's module, and megatron.core for a Megatron rank) and constructs nothing (the
        classes' own init arguments differ)."""

        def __init__(self, worker: str) -> None:
            import importlib

            from single_controller.megatron.core_import import import_megatron_core

            modules = rank_imports(import_class(worker))
            if any(module.startswith("megatron.") for module in modules):
                import_megatron_core()  # as a Megatron rank imports it
            for module in modules:
                importlib.import_module(module)

    return Importer


def start_ranks(workers: dict[str, int], num_cpus: float = 0.05) -> float:
    """Seconds from nothing to every rank of ``{worker class: ranks}`` answering, in this
    process: ``ray.init`` and one actor process per rank importing its class, as the
    service starts them."""
    import ray

    started = time.perf_counter()
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    importer = _importer()
    actors = [importer.options(num_cpus=num_cpus).remote(worker) for worker, ranks in workers.items()
              for _ in range(ranks)]
    ray.get([a.__ray_ready__.remote() for a in actors])
    took = time.perf_counter() - started
    ray.shutdown()
    return took


class Add(BaseModel):
    x: float


def build_app(ranks: int) -> Any:
    import ray
    from fastapi import FastAPI

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    actors = rank_actors(WORKER, ranks)
    ray.get([a.__ray_ready__.remote() for a in actors])
    app = FastAPI()

    @app.get("/ready")
    async def ready() -> dict[str, bool]:
        return {"ok": True}

    @app.post("/add")
    async def add(body: Add) -> dict[str, list]:
        outputs = await asyncio.gather(*(a.add.remote(body.x) for a in actors))
        return {"output": [o.tolist() for o in outputs]}

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ranks", type=int, default=8)
    options = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import uvicorn

    uvicorn.run(build_app(options.ranks), host="127.0.0.1", port=options.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
