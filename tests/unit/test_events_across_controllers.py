"""The event stream where controllers run in replicas of their own
(``hybridflow.serve.backend.ServeBackend``), over stand-ins for the controllers' Serve
handles that stream from real event buses: ids that join every controller's, a resume from
such an id in any ingress (no state kept between streams), a group's filter following its
controller only, ids of the wrong shape refused, and a controller's stream that ends
(its replica restarted) ending the merged one."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hybridflow.control.contract import ControllerError, ErrorKind
from hybridflow.control.events import EventBus, EventStream
from hybridflow.http.settings import IngressSettings
from hybridflow.serve.backend import ServeBackend, event_cursor


class BusHandle:
    """What ServeBackend asks of a controller deployment's handle for events."""

    def __init__(self, bus: EventBus) -> None:
        self.bus = bus
        self.last_event_id = SimpleNamespace(remote=self._last)
        self.stream_events = SimpleNamespace(remote=self._stream)
        self.subscriptions: list = []

    async def _last(self) -> int:
        return self.bus.last_id

    def options(self, stream: bool = False) -> BusHandle:
        assert stream
        return self

    def _stream(self, since, group):
        subscription = self.bus.subscribe(since, group)
        self.subscriptions.append(subscription)

        async def events():
            try:
                async for event in subscription:
                    yield event
            finally:
                subscription.close()

        return events()

    def end(self) -> None:
        """Its replica went away: every stream from it ends."""
        for subscription in self.subscriptions:
            subscription.close()


def backend_over(*names: str) -> tuple[ServeBackend, dict[str, BusHandle]]:
    handles = {name: BusHandle(EventBus(kept=100)) for name in names}
    settings = IngressSettings(groups={f"g_{name}": name for name in names}, request_timeout_s=5)
    return ServeBackend(handles, settings), handles


async def take(stream: EventStream, count: int) -> list:
    return [await asyncio.wait_for(stream.events.__anext__(), 5) for _ in range(count)]


def test_ids_join_every_controllers_and_resume_in_any_ingress():
    async def scenario():
        backend, handles = backend_over("a", "b")
        handles["a"].bus.publish("job", "g_a", job_id="earlier", status="queued")
        stream = await backend.events(None, None)
        assert stream.after == "1.0"  # where it starts: after every event so far
        handles["b"].bus.publish("rank_lost", "g_b", rank=2, node="n", reason="ActorDiedError")
        handles["a"].bus.publish("job", "g_a", job_id="j", status="running")
        got = await take(stream, 2)  # the controllers' streams interleave in no fixed order
        expected = {"rank_lost": "1.1", "job": "2.0"}[got[0].kind]
        assert [e.id for e in got] == [expected, "2.1"] and {e.kind for e in got} == {"rank_lost", "job"}
        handles["b"].bus.publish("rank_replaced", "g_b", rank=2, seconds=1.5)
        assert (await take(stream, 1))[0].id == "2.2"
        await stream.events.aclose()
        other_ingress = ServeBackend(handles, backend.settings)
        resumed = await other_ingress.events("1.1", None)  # after a's first event and b's first
        got = await take(resumed, 2)
        expected = {"job": "2.1", "rank_replaced": "1.2"}[got[0].kind]
        assert [e.id for e in got] == [expected, "2.2"] and {e.kind for e in got} == {"job", "rank_replaced"}
        await resumed.events.aclose()
        only_b = await backend.events("0.0", "g_b")
        assert [e.id for e in await take(only_b, 2)] == ["0.1", "0.2"]  # a's part stays where it was
        await only_b.events.aclose()
        for _ in range(5):  # the followers' cancellation reaches the controllers' streams
            await asyncio.sleep(0)
        assert all(handle.bus.readers == 0 for handle in handles.values())

    asyncio.run(scenario())


def test_ids_of_another_shape_are_refused_and_one_controller_gives_plain_numbers():
    async def scenario():
        backend, _ = backend_over("a", "b")
        for wrong in ("3", "1.2.3", "a.b", "-1.0", "0.0.0"):
            refused = await backend.events(wrong, None)
            assert isinstance(refused, ControllerError) and refused.kind is ErrorKind.BAD_ARGUMENTS
            assert "not an event id of this service (2 numbers joined by dots" in refused.message
        unknown = await backend.events(None, "nope")
        assert isinstance(unknown, ControllerError) and unknown.kind is ErrorKind.UNKNOWN_GROUP
        alone, handles = backend_over("a")
        handles["a"].bus.publish("job", "g_a", job_id="j", status="queued")
        stream = await alone.events("0", None)
        assert (await take(stream, 1))[0].id == 1
        await stream.events.aclose()

    asyncio.run(scenario())
    assert event_cursor(None, 2) is None and event_cursor(" 4.0 ", 2) == [4, 0] and event_cursor("0", 3) == [0, 0, 0]


def test_a_controller_stream_that_ends_ends_the_merged_one():
    async def scenario():
        backend, handles = backend_over("a", "b")
        stream = await backend.events(None, None)

        async def read_all() -> list:
            return [event async for event in stream.events]

        reading = asyncio.ensure_future(read_all())
        while not handles["a"].subscriptions:  # its follower subscribed
            await asyncio.sleep(0.01)
        handles["a"].end()  # its replica went away
        assert await asyncio.wait_for(reading, 5) == []  # the client reconnects with the last id it got
        for _ in range(5):
            await asyncio.sleep(0)
        assert handles["b"].bus.readers == 0  # the other controller's stream let go too

    asyncio.run(scenario())
