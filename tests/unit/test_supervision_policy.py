"""A group's supervision without Ray: the config's defaults and refusals, the restart
window, the backoff, and what a lost rank leads to under each policy."""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError, SupervisionConfig, load_config
from hybridflow.control.restarts import (
    Backoff,
    Decision,
    RestartWindow,
    Supervision,
    may_restart,
    on_rank_lost,
)

COUNTER = "tests.ray.fault_workers:Counter"
PLAIN = "single_controller.models.tutorial_workers:Accumulator"


def test_the_defaults_are_todays_behaviour_bounded():
    config = SupervisionConfig()
    assert config.on_rank_lost == "rebuild_group"
    assert (config.max_restarts, config.restart_window_s) == (10, 600)
    assert (config.backoff_s.initial, config.backoff_s.max) == (1, 60)


def test_the_window_allows_max_restarts_then_says_why_it_halts():
    window = RestartWindow(max_restarts=5, window_s=300)
    for second in range(5):
        assert window.allows(second * 10.0)
        window.record(second * 10.0)
    assert not window.allows(45.0)
    assert window.reason(45.0) == "restarted 5 times in 300 s"
    # the first restart (at 0 s) leaves the window at 300 s: one more is allowed then
    assert not window.allows(299.9)
    assert window.allows(300.0) and window.count(300.0) == 4
    window.clear()
    assert window.count(300.0) == 0


def test_max_restarts_zero_halts_at_the_first_lost_rank():
    config = SupervisionConfig(max_restarts=0)
    window = RestartWindow(0, 600)
    assert on_rank_lost(config, window, 1.0) is Decision.HALT_INTENSITY
    assert window.count(1.0) == 0


def test_the_backoff_doubles_to_its_maximum_and_starts_again_after_a_success():
    backoff = Backoff(initial=0.5, maximum=3.0)
    assert [backoff.failed() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    backoff.succeeded()
    assert backoff.failed() == 0.5
    huge = Backoff(1.0, 60.0)
    for _ in range(200):  # no overflow however long a start keeps failing
        delay = huge.failed()
    assert delay == 60.0


@pytest.mark.parametrize("policy, decision", [
    ("rebuild_group", Decision.REBUILD), ("replace_rank", Decision.REPLACE), ("halt", Decision.HALT),
])
def test_each_policy_answers_a_lost_rank(policy, decision):
    config = SupervisionConfig(on_rank_lost=policy, max_restarts=2, restart_window_s=100)
    window = RestartWindow(2, 100)
    assert on_rank_lost(config, window, 0.0) is decision
    # a halt is no restart; a rebuild or a replacement is one
    assert window.count(0.0) == (0 if policy == "halt" else 1)


def test_restarts_past_the_window_halt_every_restarting_policy():
    for policy in ("rebuild_group", "replace_rank"):
        supervision = Supervision(SupervisionConfig(on_rank_lost=policy, max_restarts=3, restart_window_s=60))
        decisions = [on_rank_lost(supervision.config, supervision.window, t) for t in (1.0, 2.0, 3.0, 4.0)]
        assert decisions[3] is Decision.HALT_INTENSITY and Decision.HALT_INTENSITY not in decisions[:3]
        assert not may_restart(supervision.window, 5.0)  # a failed start's next try is refused too
        assert may_restart(supervision.window, 61.5)  # the first two left the window
        supervision.reset()
        assert supervision.window.count(62.0) == 0 and supervision.backoff.failures == 0


def _config(group: dict, deployment_extra: list[dict] | None = None) -> dict:
    return {"deployments": [{"name": "d", "groups": [group, *(deployment_extra or [])]}]}


def _refusal(group: dict, extra: list[dict] | None = None, check_workers: bool = True) -> str:
    with pytest.raises(ConfigError) as refused:
        load_config(_config(group, extra), check_workers=check_workers)
    return str(refused.value)


def test_replace_rank_is_refused_where_one_rank_cannot_be_replaced_alone():
    replace = {"supervision": {"on_rank_lost": "replace_rank"}}
    megatron = {"name": "mlp", "worker": "single_controller.models.mlp_worker:MLPLayerWorker",
                "pool": {"process_on_nodes": [2]}, "megatron": {"tensor_model_parallel_size": 2}, **replace}
    message = _refusal(megatron, check_workers=False)
    assert ("deployments[d].groups[mlp].supervision.on_rank_lost: replace_rank is refused: a Megatron group's ranks "
            "share process groups") in message
    plain = {"name": "acc", "worker": PLAIN, "plain_actor": True, **replace}
    assert "a plain actor is a group of one" in _refusal(plain, check_workers=False)
    base = {"name": "a", "worker": COUNTER, "pool": {"process_on_nodes": [2]}}
    colocated = {"name": "b", "worker": COUNTER, "pool": {"same_as": "a"}, "colocate_with": ["a"], **replace}
    message = _refusal({**base, **replace}, [colocated], check_workers=False)
    assert "groups[b].supervision.on_rank_lost: replace_rank is refused: its processes are shared" in message
    merged = {"name": "m", "worker": COUNTER, "pool": {"merge": ["a", "c"]}, **replace}
    other = {"name": "c", "worker": COUNTER, "pool": {"process_on_nodes": [2]}}
    assert "its processes are on merged pools" in _refusal(base, [other, merged], check_workers=False)


def test_replace_rank_needs_the_state_methods_and_colocated_groups_one_supervision():
    no_state = {"name": "t", "worker": "single_controller.models.tutorial_workers:GPUAccumulatorDecorator",
                "pool": {"process_on_nodes": [2]}, "supervision": {"on_rank_lost": "replace_rank"}}
    assert load_config(_config(no_state)).deployments[0].groups[0].supervision.on_rank_lost == "replace_rank"
    stateless = {**no_state, "worker": "tests.ray.pool_workers:EnvReader"}
    message = _refusal(stateless)
    assert "has no state_dict() and load_state_dict() to restore the replaced rank with" in message
    a = {"name": "a", "worker": COUNTER, "pool": {"process_on_nodes": [2]}, "supervision": {"on_rank_lost": "halt"}}
    b = {"name": "b", "worker": COUNTER, "pool": {"same_as": "a"}, "colocate_with": ["a"]}
    assert "colocated groups start and fail together and need the same supervision: a, b" in _refusal(a, [b])


def test_supervision_fields_are_checked_by_their_ranges():
    group = {"name": "a", "worker": COUNTER, "pool": {"process_on_nodes": [2]}}
    message = _refusal({**group, "supervision": {"on_rank_lost": "retry", "max_restarts": -1,
                                                 "backoff_s": {"initial": 5, "max": 1}}}, check_workers=False)
    assert "supervision.on_rank_lost" in message and "supervision.max_restarts" in message
    assert "max (1) is below initial (5)" in message


# -- the supervisor's tries after failed starts, without Ray ------------------------------


class _NothingStored:
    in_place = False

    async def restore(self, member) -> int:
        return 0


def _unit(name: str, start, supervision: dict):
    from hybridflow.config import GroupConfig
    from hybridflow.control.builder import Unit
    from hybridflow.control.supervisor import GroupState, UnitState

    member = GroupState(config=GroupConfig(name=name, worker=PLAIN, plain_actor=True, supervision=supervision),
                        methods={}, worker_class="Accumulator", resource_pool="", durability=_NothingStored())
    unit = UnitState(Unit(name, [name], start), [member])
    member.unit = unit
    return unit


def test_failed_starts_are_tried_after_a_doubling_backoff_until_the_window_halts_the_group(monkeypatch):
    import asyncio

    from hybridflow.control import metrics
    from hybridflow.control.supervisor import Supervisor

    recorded: dict[str, list] = {"restarted": [], "halted": [], "unready": []}
    monkeypatch.setattr(metrics, "group_restarted", lambda group: recorded["restarted"].append(group))
    monkeypatch.setattr(metrics, "group_halted", lambda group: recorded["halted"].append(group))
    monkeypatch.setattr(metrics, "group_unready", lambda group, seconds: recorded["unready"].append(seconds))
    tries: list[str] = []

    def start() -> dict:
        tries.append(unit.status)
        raise OSError("no bundle for the worker yet")  # may pass: tried again

    unit = _unit("g", start, {"max_restarts": 3, "restart_window_s": 60, "backoff_s": {"initial": 0.05, "max": 0.1}})
    supervisor = Supervisor([unit], request_timeout_s=5, health_timeout_s=1)
    delays: list[float] = []  # the waits the supervisor scheduled after each failure
    backoff = unit.supervision.backoff
    real_failed = backoff.failed
    backoff.failed = lambda: delays.append(real_failed()) or delays[-1]

    async def scenario():
        with pytest.raises(OSError):
            await supervisor.start_all()
        assert unit.status == "failed" and not unit.halted
        assert unit.last_error == "start failed: OSError: no bundle for the worker yet; tried again in 0.05 s"
        while not unit.halted:
            await asyncio.sleep(0.01)

    asyncio.run(scenario())
    supervisor.shutdown()
    assert tries == ["starting", "rebuilding", "rebuilding", "rebuilding"]  # the first, then max_restarts tries
    assert unit.restarts == 3
    assert delays == [0.05, 0.1, 0.1, 0.1]  # doubled, then at its max (the last failure's was never waited)
    assert unit.last_error.startswith("restarted 3 times in 60 s; the last try: rebuild failed: OSError: no bundle")
    assert "POST /v1/admin/groups/g/restart" in unit.last_error
    events = [(e.kind, e.fields.get("status")) for e in supervisor.events._ring]
    tried = [("group_status", "rebuilding"), ("group_status", "failed")]
    assert events == [("group_status", "failed"), *tried * 3, ("group_halted", None)]
    assert recorded["restarted"] == ["g"] * 3 and recorded["halted"] == ["g"]
    assert recorded["unready"] and all(seconds > 0 for seconds in recorded["unready"])  # never ready: all counted
