"""A group's submissions keep the journal's order whether they run on the event loop or in
the group's thread: a large call goes to the thread, and every call behind it follows it
there until the thread is idle again; the loop keeps running meanwhile."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import torch

from hybridflow.control.submissions import Submissions, large
from hybridflow.wire.loop_work import OFF_LOOP_BYTES, RAW_BYTES_PER_PARSED_BYTE


def test_large_counts_what_a_call_holds_its_buffers_as_copies():
    assert not large(([1, 2, 3], {"x": "small"}))
    assert large(((), {"text": "x" * OFF_LOOP_BYTES}))  # pickled object by object
    assert large(([list(range(OFF_LOOP_BYTES // 8))], {}))
    raw = OFF_LOOP_BYTES * RAW_BYTES_PER_PARSED_BYTE  # a buffer is only copied
    assert not large(([np.zeros(OFF_LOOP_BYTES, np.uint8)], {}))
    assert not large(([torch.zeros(OFF_LOOP_BYTES // 4)], {}))  # a [8, 2, 4096] FP32 inference's input
    assert large(([np.zeros(raw, np.uint8)], {})) and large(({"x": torch.zeros(raw // 4)},))
    assert large(([np.zeros(raw // 2, np.uint8), np.zeros(raw // 2, np.uint8)], {}))


def test_calls_keep_their_order_through_the_thread_and_the_loop_keeps_answering():
    order: list[int] = []
    loop_ticks: list[float] = []
    release = threading.Event()

    def submit(i: int, wait: bool = False):
        def run() -> int:
            if wait:
                release.wait(5)
            order.append(i)
            return i
        return run

    async def scenario() -> list[int]:
        submissions = Submissions("g")
        answers = [
            submissions.submit(submit(0), off_loop=False),            # small, nothing queued: at once
            submissions.submit(submit(1, wait=True), off_loop=True),  # large: the thread
            submissions.submit(submit(2), off_loop=False),            # small, behind a large one: the thread
            submissions.submit(submit(3), off_loop=False),
        ]
        assert order == [0]  # the ones in the thread wait for the large one
        for _ in range(5):  # the loop is free while the thread works
            loop_ticks.append(time.monotonic())
            await asyncio.sleep(0.01)
        release.set()
        done = [await a if isinstance(a, asyncio.Future) else a for a in answers]
        await asyncio.sleep(0)  # the thread's done callbacks
        after = submissions.submit(submit(4), off_loop=False)  # the thread is idle again: at once
        submissions.shutdown()
        return [*done, after]

    assert asyncio.run(scenario()) == [0, 1, 2, 3, 4]
    assert order == [0, 1, 2, 3, 4] and len(loop_ticks) == 5


def test_a_submission_that_raises_in_the_thread_fails_its_future_only():
    async def scenario() -> tuple[str, int]:
        submissions = Submissions("g")

        def broken() -> int:
            raise TypeError("cannot pickle")

        failed = submissions.submit(broken, off_loop=True)
        fine = submissions.submit(lambda: 7, off_loop=False)
        try:
            await failed
        except TypeError as exc:
            why = str(exc)
        value = await fine
        submissions.shutdown()
        return why, value

    assert asyncio.run(scenario()) == ("cannot pickle", 7)
