"""The dynamic batcher (hybridflow.control.batching) on a plain event loop, no Ray: what shares a
batch, what a batch is, and what each request gets back. No timing assertions: the
tests say which requests run together, never how fast."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hybridflow.config import ConfigError, load_config
from hybridflow.control.batching import TIMER_SLACK_S, Batcher, _Waiting, run_alone


class Group:
    """Stands in for a group running a row-wise method: it records every call's input
    and answers ``tanh(x) * 3 + 1`` (each row from its own input row)."""

    def __init__(self, fail: Exception | None = None, gate: asyncio.Event | None = None) -> None:
        self.calls: list[torch.Tensor] = []
        self.fail = fail
        self.gate = gate

    async def run(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x)
        if self.gate is not None:
            await self.gate.wait()
        await asyncio.sleep(0)
        if self.fail is not None:
            raise self.fail
        return torch.tanh(x) * 3 + 1


def alone(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 3 + 1


def run(coroutine):
    return asyncio.run(coroutine)


def test_concurrent_requests_share_one_call_and_get_their_own_rows():
    group = Group()
    xs = [torch.randn(8, 2, 16) for _ in range(6)]

    async def main():
        batcher = Batcher(group.run, max_batch_size=16, max_delay_s=0.05, batch_dim=1)
        return await asyncio.gather(*(batcher.submit(x) for x in xs)), batcher

    answers, batcher = run(main())
    assert [list(c.shape) for c in group.calls] == [[8, 12, 16]]
    for x, answer in zip(xs, answers, strict=True):
        assert torch.equal(answer.output, alone(x))
        assert answer.batch_size == 6
        assert answer.output._base is None  # a tensor of its own, not a view of the batch
    assert (batcher.batches, batcher.requests) == (1, 6)


def test_max_batch_size_bounds_a_batch_and_one_batch_runs_at_a_time():
    gate = asyncio.Event()
    group = Group(gate=gate)
    xs = [torch.full((1, 4), float(i)) for i in range(10)]

    async def main():
        batcher = Batcher(group.run, max_batch_size=4, max_delay_s=0.01)
        tasks = [asyncio.create_task(batcher.submit(x)) for x in xs]
        for _ in range(20):
            await asyncio.sleep(0)
        in_flight = len(group.calls)  # the first batch holds the group; the rest wait
        gate.set()
        return in_flight, await asyncio.gather(*tasks)

    in_flight, answers = run(main())
    assert in_flight == 1
    assert [c.shape[0] for c in group.calls] == [4, 4, 2]
    # arrival order is kept: the first four share the first call
    assert [float(c[0, 0]) for c in group.calls] == [0.0, 4.0, 8.0]
    assert [a.batch_size for a in answers] == [4] * 8 + [2] * 2
    assert all(torch.equal(a.output, alone(x)) for a, x in zip(answers, xs, strict=True))


def test_requests_of_different_shapes_or_dtypes_never_share_a_batch():
    group = Group()
    xs = (
        [torch.randn(2, 3) for _ in range(3)]
        + [torch.randn(2, 4) for _ in range(3)]
        + [torch.randn(2, 3, dtype=torch.float64) for _ in range(2)]
        + [torch.randn(3, 3) for _ in range(2)]
    )

    async def main():
        batcher = Batcher(group.run, max_batch_size=16, max_delay_s=0.01)
        return await asyncio.gather(*(batcher.submit(x) for x in xs))

    answers = run(main())
    kinds = sorted((tuple(c.shape), str(c.dtype)) for c in group.calls)
    # [2, 3] and [3, 3] share a dtype and a batch dimension's width but not a batch
    assert kinds == [((4, 3), "torch.float64"), ((6, 3), "torch.float32"), ((6, 3), "torch.float32"),
                     ((6, 4), "torch.float32")]
    for x, answer in zip(xs, answers, strict=True):
        assert answer.output.dtype == x.dtype and torch.equal(answer.output, alone(x))


def test_a_request_whose_rows_before_the_batch_dimension_are_not_a_multiple_of_tp_runs_alone():
    # a tp=4 layer's all-reduce sums each quarter of the flattened output in its own order:
    # seq 8 keeps every value in its quarter when batched along dim 1, seq 7 does not
    group = Group()
    xs = [torch.randn(8, 2, 4) for _ in range(3)] + [torch.randn(7, 2, 4) for _ in range(3)]

    async def main():
        batcher = Batcher(group.run, max_batch_size=16, max_delay_s=0.01, batch_dim=1, row_multiple=4)
        return await asyncio.gather(*(batcher.submit(x) for x in xs))

    answers = run(main())
    assert sorted(list(c.shape) for c in group.calls) == [[7, 2, 4]] * 3 + [[8, 6, 4]]
    assert [a.batch_size for a in answers] == [3, 3, 3, 1, 1, 1]
    assert all(torch.equal(a.output, alone(x)) for a, x in zip(answers, xs, strict=True))


def test_a_lone_request_leaves_after_the_delay_without_others():
    group = Group()

    async def main():
        batcher = Batcher(group.run, max_batch_size=8, max_delay_s=0.02)
        return await batcher.submit(torch.ones(3, 2))

    answer = run(main())
    assert answer.batch_size == 1 and torch.equal(answer.output, alone(torch.ones(3, 2)))
    assert len(group.calls) == 1


def test_without_waiting_when_idle_a_lone_request_leaves_at_once_and_later_ones_batch_behind_it():
    """wait_when_idle=False: the first request finds nothing running and leaves without the
    (here 60 s) delay; those that arrive while it runs leave together when it is done."""
    gate = asyncio.Event()
    group = Group(gate=gate)
    xs = [torch.randn(4, 2) for _ in range(4)]

    async def main():
        batcher = Batcher(group.run, max_batch_size=8, max_delay_s=60.0, wait_when_idle=False)
        first = asyncio.ensure_future(batcher.submit(xs[0]))
        while not group.calls:  # it left alone, without waiting for the delay
            await asyncio.sleep(0)
        later = [asyncio.ensure_future(batcher.submit(x)) for x in xs[1:]]
        await asyncio.sleep(0.01)
        assert len(group.calls) == 1 and batcher.waiting() == 3  # held while the first runs
        gate.set()
        return await asyncio.wait_for(asyncio.gather(first, *later), timeout=30)

    answers = run(main())
    assert [list(c.shape) for c in group.calls] == [[4, 2], [12, 2]]
    assert [a.batch_size for a in answers] == [1, 3, 3, 3]
    assert all(torch.equal(a.output, alone(x)) for a, x in zip(answers, xs, strict=True))


def test_waiting_when_idle_is_the_default_and_the_config_can_turn_it_off():
    assert Batcher(Group().run, max_batch_size=2, max_delay_s=0.0).wait_when_idle is True
    args = {"deployments": [{"name": "d", "groups": [COUNTER], "models": [
        {**MODEL, "batching": {"max_batch_size": 8, "max_queue_delay_microseconds": 500, "wait_when_idle": False}}]}]}
    assert load_config(args).deployments[0].models[0].batching.wait_when_idle is False


def test_the_delay_is_a_maximum_a_batch_due_within_the_timer_slack_leaves_now():
    """The loop's timers fire up to a millisecond late (epoll sleeps in whole ms), so a
    batch whose deadline is nearer than that leaves now rather than after the deadline."""
    arrived, delay = 100.0, 0.005

    async def main():
        batcher = Batcher(Group().run, max_batch_size=16, max_delay_s=delay, batch_dim=1)
        x = torch.zeros(1, 1)
        waiting = _Waiting(x, asyncio.get_running_loop().create_future(), arrived=arrived)
        batcher._queues[(tuple(x.shape), x.dtype)] = [waiting]
        return [batcher._next(arrived + delay - ahead) for ahead in (TIMER_SLACK_S / 2, 2 * TIMER_SLACK_S)]

    (due, _), (not_yet, wake_at) = run(main())
    assert due == ((1, 1), torch.float32)
    assert not_yet is None and wake_at == pytest.approx(arrived + delay - TIMER_SLACK_S)  # when it is due


def test_an_error_reaches_every_request_of_its_batch_and_the_batcher_goes_on():
    group = Group(fail=RuntimeError("worker raised"))

    async def main():
        batcher = Batcher(group.run, max_batch_size=4, max_delay_s=0.01)
        failed = await asyncio.gather(*(batcher.submit(torch.ones(1, 2)) for _ in range(3)), return_exceptions=True)
        group.fail = None
        return failed, await batcher.submit(torch.zeros(1, 2))

    failed, after = run(main())
    assert [str(f) for f in failed] == ["worker raised"] * 3
    assert torch.equal(after.output, alone(torch.zeros(1, 2)))


def test_an_output_that_does_not_split_back_is_an_error_naming_the_method_as_not_row_wise():
    async def summed(x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=0, keepdim=True)

    async def main():
        batcher = Batcher(summed, max_batch_size=4, max_delay_s=0.01)
        return await asyncio.gather(*(batcher.submit(torch.ones(2, 2)) for _ in range(2)), return_exceptions=True)

    errors = run(main())
    assert all(isinstance(e, ValueError) and "not row-wise" in str(e) for e in errors)


def test_a_request_whose_caller_went_away_is_not_run():
    gate = asyncio.Event()
    group = Group(gate=gate)

    async def main():
        batcher = Batcher(group.run, max_batch_size=4, max_delay_s=0.0)
        first = asyncio.create_task(batcher.submit(torch.zeros(1, 2)))
        for _ in range(5):
            await asyncio.sleep(0)  # the first holds the group
        gone = asyncio.create_task(batcher.submit(torch.ones(1, 2)))
        kept = asyncio.create_task(batcher.submit(torch.full((1, 2), 2.0)))
        await asyncio.sleep(0)
        gone.cancel()
        gate.set()
        return await first, await kept, batcher

    first, kept, batcher = run(main())
    assert [c.tolist() for c in group.calls] == [[[0.0, 0.0]], [[2.0, 2.0]]]
    assert kept.batch_size == 1 and batcher.waiting() == 0


def test_a_model_that_does_not_batch_runs_each_request_alone():
    group = Group()
    answer = run(run_alone(group.run, torch.ones(2, 2)))
    assert answer.batch_size == 1 and answer.queue_s == 0.0 and torch.equal(answer.output, alone(torch.ones(2, 2)))


def test_bad_batcher_settings_are_refused():
    with pytest.raises(ValueError, match="max_batch_size"):
        Batcher(Group().run, max_batch_size=0, max_delay_s=0.0)
    with pytest.raises(ValueError, match="dimension 2"):
        run(Batcher(Group().run, max_batch_size=2, max_delay_s=0.0, batch_dim=2).submit(torch.ones(3, 3)))


MODEL = {"name": "m", "group": "counter", "method": "add",
         "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4, 8]}],
         "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, -1, 8]}]}
COUNTER = {"name": "counter", "worker": "single_controller.models.tutorial_workers:GPUAccumulator",
           "pool": {"process_on_nodes": [2]}}


def test_batching_needs_a_size_free_batch_dimension_in_the_config():
    def args(batching):
        return {"deployments": [{"name": "d", "groups": [COUNTER], "models": [{**MODEL, "batching": batching}]}]}

    config = load_config(args({"max_batch_size": 8, "max_queue_delay_microseconds": 500, "batch_dim": 0}))
    assert config.deployments[0].models[0].batching.max_batch_size == 8
    with pytest.raises(ConfigError, match=r"batch_dim 1: 'x' of shape \[-1, 4, 8\]"):
        load_config(args({"max_batch_size": 8, "batch_dim": 1}))
    with pytest.raises(ConfigError, match="batch_dim 3"):
        load_config(args({"max_batch_size": 8, "batch_dim": 3}))
    # no batching: the dimension is not looked at
    load_config(args({"max_batch_size": 1, "batch_dim": 1}))
