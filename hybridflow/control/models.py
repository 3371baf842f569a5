"""Open Inference Protocol models served by a controller: a model is one group method
taking one tensor and returning one tensor (``deployments[].models`` in the config).

The controller owns a model's current inputs and outputs (a model declared with an
``io_method`` asks its group for them, since a layer re-initialised at another size
takes other shapes), checks each request's input against them before anything runs,
and calls the group: a call per request, or, for a model with ``batching``, one call for
concurrent requests (``hybridflow.control.batching``).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

from hybridflow.config import ModelConfig
from hybridflow.control import metrics, model_statistics
from hybridflow.control.batching import Batcher, Ran, run_alone
from hybridflow.control.contract import CallRequest, ControllerError, ErrorKind, InferResult
from hybridflow.control.group_state import READY, as_asyncio
from hybridflow_client.wire.tensors import datatype_of_torch as datatype_of


class ModelServer:
    def __init__(self, models: list[ModelConfig], controller: Any) -> None:
        self.models = {model.name: model for model in models}
        self.controller = controller
        self._specs: dict[str, tuple[tuple[int, int], dict[str, Any]]] = {}
        #: Models that batch concurrent requests (hybridflow.control.batching), by name.
        self.batchers = {
            m.name: Batcher(functools.partial(self._run, m), m.batching.max_batch_size,
                            m.batching.max_queue_delay_microseconds / 1e6, m.batching.batch_dim,
                            row_multiple=_tensor_parallel_size(controller, m.group),
                            wait_when_idle=m.batching.wait_when_idle)
            for m in models if m.batching.max_batch_size > 1
        }

    def ready(self, name: str) -> bool:
        model = self.models.get(name)
        return model is not None and self.controller.groups[model.group].serving

    def _unknown(self, name: str) -> ControllerError:
        return ControllerError(ErrorKind.UNKNOWN_MODEL, f"unknown model {name!r}; models: {', '.join(self.models)}")

    async def spec(self, name: str) -> dict[str, Any] | ControllerError:
        """The model's inputs and outputs as they are now."""
        model = self.models.get(name)
        if model is None:
            return self._unknown(name)
        declared = {
            "inputs": [t.model_dump() for t in model.inputs],
            "outputs": [t.model_dump() for t in model.outputs],
        }
        if model.io_method is None:
            return declared
        state = self.controller.groups[model.group]
        if state.status != READY or state.group is None:
            return declared
        version = (state.unit.generation, state.state_version)
        kept = self._specs.get(name)
        if kept is not None and kept[0] == version:
            return kept[1]
        pending = await state.submissions.submitted(lambda: state.caller.submit(model.io_method))
        values = [await future for future in as_asyncio(pending.futures)]
        answer = pending.collect(values)
        if isinstance(answer, list):
            answer = answer[0]
        spec = {"inputs": answer.get("inputs", declared["inputs"]), "outputs": answer.get("outputs", declared["outputs"])}
        self._specs[name] = (version, spec)
        return spec

    def statistics(self, name: str) -> dict[str, Any] | ControllerError:
        """The model's cumulative statistics, as Triton's statistics extension reports them."""
        if name not in self.models:
            return self._unknown(name)
        return model_statistics.of(name).as_triton()

    async def metadata(self, name: str) -> dict[str, Any] | ControllerError:
        spec = await self.spec(name)
        if isinstance(spec, ControllerError):
            return spec
        return {
            "name": name,
            "versions": ["1"],
            "platform": self.models[name].platform,
            "inputs": spec["inputs"],
            "outputs": spec["outputs"],
        }

    @metrics.observed_inference
    async def infer(self, name: str, inputs: dict[str, torch.Tensor]) -> InferResult:
        """Run the model on one request's inputs; the output tensors by name."""
        model = self.models.get(name)
        if model is None:
            return InferResult(error=self._unknown(name))
        spec = await self.spec(name)
        problem = check_inputs(inputs, spec["inputs"])
        if problem:
            return InferResult(error=ControllerError(ErrorKind.BAD_INPUT, problem))
        (x,) = inputs.values()
        started = time.perf_counter()
        batcher = self.batchers.get(name)
        try:
            done = await (batcher.submit(x) if batcher else run_alone(functools.partial(self._run, model), x))
        except GroupCallFailed as exc:
            return InferResult(error=exc.error, compute_s=time.perf_counter() - started)
        except ValueError as exc:  # a batch's output that does not split back per request
            return InferResult(error=ControllerError(ErrorKind.METHOD_RAISED, str(exc)))
        return InferResult(
            outputs={spec["outputs"][0]["name"]: done.output},
            queue_s=done.queue_s, compute_s=done.compute_s, batch_size=done.batch_size,
            weights_version=done.weights_version,
        )

    async def _run(self, model: ModelConfig, x: torch.Tensor) -> Ran:
        """One group call of the model's method on ``x`` (one request, or a batch), with
        the version of the weights it ran on."""
        call = await self.controller.run(
            CallRequest(model.group, model.method, args=[[x]] if model.dp_list else [x])
        )
        if call.error is not None:
            raise GroupCallFailed(call.error)
        return Ran(call.output[0] if model.dp_list else call.output, call.weights_version)


def _tensor_parallel_size(controller: Any, group: str) -> int:
    megatron = controller.groups[group].config.megatron
    return megatron.tensor_model_parallel_size if megatron is not None else 1


class GroupCallFailed(Exception):
    """A model's group call answered an error (every request of its batch gets it)."""

    def __init__(self, error: ControllerError) -> None:
        super().__init__(error.message)
        self.error = error


def check_inputs(inputs: dict[str, torch.Tensor], declared: list[dict[str, Any]]) -> str | None:
    """Why the inputs do not fit the declared ones (names, datatype, shape with -1 for
    any size, not empty), or None."""
    names = [d["name"] for d in declared]
    if sorted(inputs) != sorted(names):
        return f"model takes inputs {names}, got {sorted(inputs)}"
    for spec in declared:
        tensor = inputs[spec["name"]]
        try:
            datatype = datatype_of(tensor.dtype)
        except ValueError:
            datatype = str(tensor.dtype)
        if datatype != spec["datatype"]:
            return f"input {spec['name']!r} must be {spec['datatype']}, got {datatype}"
        shape = spec["shape"]
        if tensor.dim() != len(shape) or any(d not in (-1, s) for d, s in zip(shape, tensor.shape, strict=True)):
            return f"input {spec['name']!r} must have shape {shape} (-1: any), got {list(tensor.shape)}"
        if any(s == 0 for s in tensor.shape):
            return f"input {spec['name']!r} is empty: shape {list(tensor.shape)}"
    return None
