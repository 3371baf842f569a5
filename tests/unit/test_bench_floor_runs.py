"""bench.floor_runs without running anything: the figures and ratios of the served path
against its floors from measured records, the request path a service is built for, and
the inference floor's body handling and layer (bench/infer_floor_app.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench import floor_runs
from bench.cold_start import CONTROLLERS, FLOOR_ACTOR, FLOOR_APP, INGRESS, OTHER, PROXY, RANKS, RAY_DAEMONS


def infer_record(lone: float, rps16: float, rps64: float, machine16: float, roles16: dict[str, float]) -> dict:
    """A measured infer target, as ``measure_infer`` records one."""
    window = {"machine_ms": machine16, "roles_ms": roles16, "processes_ms": sum(roles16.values())}
    return {"lone_p50_ms": lone, "lone_p99_ms": 2 * lone, "rps_16": rps16, "p50_ms_16": 10.0, "p99_ms_16": 20.0,
            "rps_64": rps64, "p50_ms_64": 30.0, "p99_ms_64": 60.0, "cpu_16": window,
            "cpu_64": {"machine_ms": machine16 + 1, "roles_ms": roles16, "processes_ms": sum(roles16.values())}}


def add_record(p50: float, rps: float, errors: int = 0) -> dict:
    return {"lone_p50_ms": p50, "lone_p99_ms": 3 * p50, "rps_32": rps, "lone_errors": 0, "errors_32": errors}


FLOOR_ROLES = {FLOOR_APP: 6.0, FLOOR_ACTOR: 100.0, RAY_DAEMONS: 2.0}
SERVICE_ROLES = {INGRESS: 9.0, PROXY: 1.0, CONTROLLERS: 0.5, RAY_DAEMONS: 1.5, OTHER: 0.0, RANKS: 110.0}


def runs() -> tuple[list[dict], dict[str, dict]]:
    floors = [
        {"add": add_record(10.0, 100.0), "infer_plain": infer_record(120.0, 8.0, 8.0, 110.0, FLOOR_ROLES),
         "infer_compiled": infer_record(100.0, 10.0, 12.0, 105.0, {FLOOR_APP: 4.0, FLOOR_ACTOR: 95.0}),
         "client_scaling": {"target": "add", "concurrency": 32, "ratio": 0.98,
                            "runs": [{"processes": 2, "rps": 100.0}, {"processes": 4, "rps": 98.0}]}},
        {"add": add_record(12.0, 110.0),
         "infer_plain": infer_record(130.0, 8.0, 8.0, 120.0, {**FLOOR_ROLES, FLOOR_APP: 8.0})},
    ]
    service = {"add": add_record(11.0, 84.0), "unbatched": infer_record(140.0, 7.0, 7.0, 125.0, SERVICE_ROLES),
               "batched": infer_record(150.0, 16.0, 20.0, 60.0, {**SERVICE_ROLES, RANKS: 45.0})}
    return floors, {"haproxy": service, "serve_proxy": {**service, "add": add_record(16.5, 55.0)}}


def test_the_ratios_compare_each_path_with_the_floors_mean_over_their_runs():
    floors, services = runs()
    out = floor_runs.figures(floors, services)
    assert out["add_floor_lone_p50_ms"] == 11.0 and out["add_floor_rps_32"] == 105.0 and out["add_floor_runs"] == 2
    assert out["add_p50_floor_ratio_haproxy"] == pytest.approx(1.0)
    assert out["add_p50_floor_ratio_serve_proxy"] == pytest.approx(1.5)
    assert out["add_rps_floor_ratio_haproxy"] == pytest.approx(84.0 / 105.0)
    assert out["add_lone_p99_ms_serve_proxy"] == pytest.approx(49.5)
    # the plain floor over its two runs: app 7, actor 100, daemons 2; its path is all but the actor
    assert out["infer_floor_plain_runs"] == 2 and out["infer_floor_compiled_runs"] == 1
    assert out["infer_floor_plain_path_cpu_ms"] == pytest.approx(9.0)
    assert out["infer_floor_plain_layer_cpu_ms"] == pytest.approx(100.0)
    assert out["infer_floor_plain_front_cpu_ms"] == pytest.approx(7.0)
    assert out["infer_floor_plain_cpu_ms_16"] == pytest.approx(115.0)
    assert out["infer_floor_plain_processes_cpu_ms"] == pytest.approx(109.0)
    # the service's path: ingress 9 + proxy 1 + controllers 0.5 + daemons 1.5 + other 0
    assert out["infer_path_cpu_ms_haproxy"] == pytest.approx(12.0)
    assert out["infer_path_cpu_ratio_haproxy"] == pytest.approx(12.0 / 9.0)
    assert out["infer_rank_cpu_ratio_haproxy"] == pytest.approx(110.0 / 100.0)
    assert out["infer_batched_cpu_ratio_serve_proxy"] == pytest.approx(60.0 / 115.0)
    assert out["infer_front_cpu_ms_haproxy"] == 9.0 and out["infer_proxy_cpu_ms_haproxy"] == 1.0
    assert out["infer_controllers_cpu_ms_haproxy"] == 0.5 and out["infer_ray_daemons_cpu_ms_haproxy"] == 1.5
    # each served figure against each floor
    assert out["infer_lone_p50_ms_vs_plain_haproxy"] == pytest.approx(140.0 / 125.0)
    assert out["infer_lone_p50_ms_vs_compiled_haproxy"] == pytest.approx(140.0 / 100.0)
    assert out["infer_batched_rps_64_vs_compiled_haproxy"] == pytest.approx(20.0 / 12.0)
    assert out["infer_batched_cpu_ms_16_vs_plain_haproxy"] == pytest.approx(60.0 / 115.0)
    assert out["served_errors"] == 0
    assert out["client_scaling_rps"] == [100.0, 98.0] and out["client_scaling_processes"] == [2, 4]
    assert out["client_scaling_ratio"] == 0.98 and "`add` floor at 32" in out["client_scaling_target"]


def test_failed_requests_of_every_window_are_counted():
    floors, services = runs()
    services["serve_proxy"]["add"] = add_record(16.5, 55.0, errors=3)
    floors[1]["infer_plain"] = {**floors[1]["infer_plain"], "lone_errors": 1, "errors_64": 2}
    assert floor_runs.figures(floors, services)["served_errors"] == 6


def test_without_the_add_floor_the_inference_figures_stand_alone():
    floors, services = runs()
    floors = [{k: v for k, v in run.items() if k != "add"} for run in floors]
    services = {path: {k: v for k, v in s.items() if k != "add"} for path, s in services.items()}
    out = floor_runs.figures(floors, services)
    assert not any(key.startswith("add_") for key in out)
    assert out["infer_rank_cpu_ratio_serve_proxy"] == pytest.approx(1.1)


def test_the_settings_say_what_the_load_generator_ran():
    quick, full = floor_runs.Settings.for_run(True, 3), floor_runs.Settings.for_run(False)
    assert quick.processes == 3 and quick.window_s < full.window_s
    figures = full.figures()
    assert figures["infer_concurrency"] == [16, 64] and figures["add_concurrency"] == 32
    assert figures["infer_shape"] == [8, 2, 4096] and figures["processes"] >= 2


def test_a_service_is_built_for_the_request_path_asked(monkeypatch):
    from tests.serve_process import ServeProcess

    monkeypatch.delenv("HYBRIDFLOW_SERVE_HAPROXY", raising=False)
    with floor_runs.request_path("serve_proxy"):
        serve_proxy = ServeProcess()
    with floor_runs.request_path("haproxy"):
        haproxy = ServeProcess()
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in serve_proxy.env
    assert haproxy.env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    import os

    assert "HYBRIDFLOW_SERVE_HAPROXY" not in os.environ  # put back as it was
    with pytest.raises(ValueError, match="unknown request path"):
        with floor_runs.request_path("grpc"):
            pass


def test_the_inference_floor_reads_the_binary_body_by_hand_and_answers_in_binary():
    from bench.http_figures import oip_body
    from bench.infer_floor_app import BadRequest, binary_response, parse_binary_request

    x = torch.rand(8, 2, 4096)
    body, headers = oip_body("x", x, binary_output=True)
    parsed = parse_binary_request(body, headers["Inference-Header-Content-Length"])
    assert parsed.shape == (8, 2, 4096) and np.array_equal(parsed, x.numpy())
    with pytest.raises(BadRequest, match="Inference-Header-Content-Length"):
        parse_binary_request(body, None)
    with pytest.raises(BadRequest, match="bytes must follow"):
        parse_binary_request(body[:-4], headers["Inference-Header-Content-Length"])
    answer, size = binary_response(parsed)
    from hybridflow_client.wire.oip_messages import parse_infer_response

    response, outputs = parse_infer_response(answer, size)
    assert response["model_name"] == "mlp" and torch.equal(outputs["y"], x)


def test_the_floors_layer_is_a_llama_mlp():
    from bench.infer_floor_app import FloorMLP

    layer = FloorMLP(8, 16)
    x = np.random.default_rng(1).random((3, 2, 8), dtype=np.float32)
    gate, up, down = (m.weight.detach().double().numpy() for m in (layer.gate, layer.up, layer.down))
    h = x.astype(np.float64)
    g = h @ gate.T
    expected = ((g / (1 + np.exp(-g))) * (h @ up.T)) @ down.T
    y = layer.forward(x)
    assert y.shape == (3, 2, 8) and y.dtype == np.float32
    assert np.allclose(y, expected, rtol=1e-4, atol=1e-6)


def test_a_floor_app_that_cannot_start_says_why():
    with pytest.raises(RuntimeError, match="exited with 2:(.|\n)*invalid choice: 'nonsense'"):
        floor_runs.start_app("bench.infer_floor_app", "--mode", "nonsense")


def test_no_ratio_to_a_floor_figure_at_or_below_zero():
    assert floor_runs.ratio(12.0, 8.0) == 1.5
    assert floor_runs.ratio(12.0, 0.0) is None and floor_runs.ratio(12.0, -3.0) is None
    assert floor_runs.ratio(None, 8.0) is None
    floors, services = runs()
    # the plain floor's path read below zero (its idle rate over its load): no path ratio
    for run in floors:
        run["infer_plain"] = infer_record(120.0, 8.0, 8.0, 110.0, {FLOOR_APP: -6.0, FLOOR_ACTOR: 100.0})
    out = floor_runs.figures(floors, services)
    assert out["infer_path_cpu_ratio_haproxy"] is None
    assert out["infer_rank_cpu_ratio_haproxy"] == pytest.approx(1.1)
