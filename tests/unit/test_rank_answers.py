"""rank_outcomes on asyncio futures (a compiled graph's answers) and outcome_of on the
results Ray hands a completion callback; tests/ray/test_worker_group.py checks the same
on a group's ObjectRefs against Ray's own futures."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import RayActorError, RayTaskError

from hybridflow.control.rank_answers import Outcome, outcome_of, rank_outcomes


def test_every_ranks_value_or_error_in_rank_order():
    async def scenario():
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(3)]
        waiting = asyncio.ensure_future(rank_outcomes(futures, 5))
        futures[2].set_result("two")
        futures[0].set_exception(KeyError("zero"))
        await asyncio.sleep(0)
        assert not waiting.done(), "answered before every rank did"
        futures[1].set_result(1)
        return await waiting

    zero, one, two = asyncio.run(scenario())
    assert isinstance(zero.error, KeyError) and zero.value is None
    assert one == Outcome(value=1) and two == Outcome(value="two")


def test_a_rank_that_does_not_answer_in_time_is_none_and_its_late_answer_harms_nothing():
    async def scenario():
        loop = asyncio.get_running_loop()
        futures = [loop.create_future(), loop.create_future()]
        futures[0].set_result(0)
        late = await rank_outcomes(futures, 0.05)
        futures[1].set_result(1)  # the call's settling gave up: nobody waits
        await asyncio.sleep(0)
        return late

    assert asyncio.run(scenario()) is None


def test_answers_already_there_and_no_ranks():
    async def scenario():
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        done.set_result(7)
        cancelled = loop.create_future()
        cancelled.cancel()
        return await rank_outcomes([done, cancelled], 1), await rank_outcomes([], 1)

    (seven, cancelled), none = asyncio.run(scenario())
    assert seven == Outcome(value=7)
    assert isinstance(cancelled.error, asyncio.CancelledError)
    assert none == []


def test_a_method_that_raised_is_its_own_exception_and_other_ray_errors_stay_as_they_are():
    raised = outcome_of(RayTaskError("add", "Traceback ...", ZeroDivisionError("division by zero")))
    assert isinstance(raised.error, ZeroDivisionError) and isinstance(raised.error, RayTaskError)
    lost = RayActorError()
    assert outcome_of(lost).error is lost
    returned = ValueError("a method may return an exception: it is its value")
    assert outcome_of(returned) == Outcome(value=returned)


@pytest.mark.parametrize("value", [0, None, "x", [1, 2]])
def test_a_value_is_the_value(value):
    assert outcome_of(value) == Outcome(value=value)
