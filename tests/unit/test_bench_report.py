"""bench.report: docs/benchmarks.md rendered from a results dict (no bench run, no Ray)."""

from __future__ import annotations

import json

import pytest

from bench import report

RESULTS = {
    "quick": True,
    "machine": "2 cores, x86_64, torch 2.13.0+cpu",
    "when": "2026-01-02 03:04:05",
    "fanout_raw_p50_ms": 2.0,
    "one_to_all_p50_ms": 2.2,
    "one_to_all_ratio": 1.1,
    "rps_add_32": 60.0,
    "rps_noop_32": 150.0,
    "rps_ratio": 0.4,
    "http_add_hops": {"requests": 50, "proxy_ms": 20.0, "proxy_minus_ingress_ms": 5.5},
    "a_figure_added_later_ms": 12.5,
    "bench_seconds": 61.0,
    "targets": {
        "one_to_all_ratio": {"label": "ONE_TO_ALL / raw", "target": 1.15, "value": 1.1, "met": True, "raw": ""},
        "rps_ratio": {"label": "add rps / no-op rps", "target": 0.5, "value": 0.4, "met": False, "raw": ""},
    },
}


def test_a_page_with_each_figure_the_figures_it_comes_from_and_its_target(tmp_path):
    page = report.write_benchmarks_page(RESULTS, tmp_path / "docs" / "benchmarks.md", results_dir=None)
    text = page.read_text()
    assert text.startswith("# Benchmarks\n")
    assert "python -m bench.report bench/results/latest.json" in text and "do not edit by hand" in text
    assert "`--quick` run on 2 cores, x86_64, torch 2.13.0+cpu, 2026-01-02 03:04:05, 61.0 s in all" in text
    row = next(line for line in text.splitlines() if line.startswith("| `one_to_all_ratio`"))
    assert "1.10x" in row and "`one_to_all_p50_ms` 2.20 ms; `fanout_raw_p50_ms` 2.00 ms" in row
    assert row.endswith("| <= 1.15x (met) |")
    rps = next(line for line in text.splitlines() if line.startswith("| `rps_ratio`"))
    assert "`rps_add_32` 60.0; `rps_noop_32` 150" in rps and rps.endswith("| >= 0.500x (**missed**) |")
    # sections without figures in the results are left out; a figure no section names still shows
    assert "## The library" in text and "## Durable state" not in text
    assert "| `a_figure_added_later_ms` | 12.5 ms |" in text
    assert "| `proxy_minus_ingress_ms` | 5.50 ms |" in text


def test_no_recorded_run_says_so(tmp_path):
    text = report.write_benchmarks_page({}, tmp_path / "benchmarks.md", results_dir=None).read_text()
    assert "No run is recorded yet" in text and "| figure" not in text


def test_the_other_tools_results_in_the_results_directory_are_added(tmp_path):
    (tmp_path / "call_cpu.json").write_text(json.dumps(
        {"add": {"calls_per_s": 80.0, "cpu_ms_per_call": 21.0, "cpu_ms_per_call_by_process": {"ray::ProxyActor": 4.5}}}
    ))
    (tmp_path / "serve_settings.json").write_text(json.dumps(
        {"default": {"ready_s": 20.0, "add_p50_ms": 20.0, "noop_p50_ms": 8.0, "add_over_noop_ms": 12.0, "hops": {}}}
    ))
    (tmp_path / "latest.json").write_text(json.dumps(RESULTS))  # the page's own run: not shown twice
    text = report.write_benchmarks_page(RESULTS, tmp_path / "benchmarks.md", results_dir=tmp_path).read_text()
    assert "| `add` | 80.0 | 21.0 ms | ProxyActor 4.50 |" in text
    assert "| default | 20.0 ms | 8.00 ms | 12.0 ms | 20.0 s | n/a |" in text
    assert "Another recorded run" not in text


def test_a_gpu_run_names_the_parts_it_ran(tmp_path):
    (tmp_path / "gpu_infer.json").write_text(json.dumps(
        {"quick": True, "machine": {"cuda": "NVIDIA H200", "cpus": 16}, "infer": {"batching_rps": 240.0}}
    ))
    (tmp_path / "gpu_full.json").write_text(json.dumps({"machine": {"cuda": "NVIDIA H100"}, "layer": {}, "infer": {}}))
    text = report.write_benchmarks_page(RESULTS, tmp_path / "benchmarks.md", results_dir=tmp_path).read_text()
    assert "Written by `python -m bench.gpu infer --quick` on NVIDIA H200, 16 CPUs." in text
    assert "Written by `python -m bench.gpu layer infer` on NVIDIA H100." in text
    assert "| `batching_rps` | 240 |" in text


def test_the_entry_point_renders_a_results_file(tmp_path):
    source = tmp_path / "latest.json"
    source.write_text(json.dumps(RESULTS))
    assert report.main([str(source), "--out", str(tmp_path / "page.md")]) == 0
    assert "| `one_to_all_ratio`" in (tmp_path / "page.md").read_text()
    assert report.main([str(tmp_path / "missing.json"), "--out", str(tmp_path / "empty.md")]) == 0
    assert "No run is recorded yet" in (tmp_path / "empty.md").read_text()


def test_the_grpc_section_shows_the_ratio_with_its_target_and_the_fronts_share(tmp_path):
    results = {
        "machine": "2 cores", "when": "now", "grpc_mlp_p50_ms": 123.0, "http_mlp_p50_ms": 120.0,
        "grpc_over_http": 1.025, "shape": [8, 2, 4096], "samples": 60, "same_answer": True,
        "grpc_echo_p50_ms": 14.0, "http_echo_p50_ms": 10.0, "echo_grpc_over_http": 1.4,
        "grpc_echo_direct_p50_ms": 9.0, "http_echo_direct_p50_ms": 8.5, "echo_direct_grpc_over_http": 9.0 / 8.5,
        "grpc_front_added_ms": 5.0, "http_front_added_ms": 1.5,
        "targets": {"grpc_over_http": {"label": "gRPC / HTTP", "target": 1.0, "value": 1.025, "met": False,
                                       "raw": ""}},
    }
    text = report.write_benchmarks_page(results, tmp_path / "benchmarks.md", results_dir=None).read_text()
    assert "## The Open Inference Protocol over gRPC" in text
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| `")}
    assert "1.02x" in rows["`grpc_over_http`"] and rows["`grpc_over_http`"].endswith("| <= 1.00x (**missed**) |")
    assert "`grpc_mlp_p50_ms` 123 ms; `http_mlp_p50_ms` 120 ms" in rows["`grpc_over_http`"]
    assert "1.40x" in rows["`echo_grpc_over_http`"] and "`grpc_echo_p50_ms` 14.0 ms" in rows["`echo_grpc_over_http`"]
    assert "1.06x" in rows["`echo_direct_grpc_over_http`"]
    assert "| 5.00 ms |" in rows["`grpc_front_added_ms`"] and "| 1.50 ms |" in rows["`http_front_added_ms`"]
    assert "## Other figures" not in text  # every figure of the run is in its section


def test_the_cold_start_rows_show_the_cpu_of_each_start_by_kind(tmp_path):
    results = {
        "machine": "2 cores", "when": "now", "cold_start_service_s": 46.0, "cold_start_floor_s": 30.0,
        "cold_start_floor_ratio": 46.0 / 30.0, "cold_start_cpu_s": 82.0, "cold_start_floor_cpu_s": 58.0,
        "cold_start_cpu_ratio": 82.0 / 58.0, "cold_start_cpu_ray_s": 7.5, "cold_start_cpu_serve_s": 8.0,
        "cold_start_cpu_replicas_s": 4.7, "cold_start_cpu_workers_s": 61.8, "cold_start_floor_cpu_workers_s": 54.0,
        "cold_start_machine_busy_fraction": 0.91,
        "targets": {"cold_start_floor_ratio": {"label": "cold start / floor", "target": 1.3, "value": 46.0 / 30.0,
                                               "met": False, "raw": ""}},
    }
    text = report.write_benchmarks_page(results, tmp_path / "benchmarks.md", results_dir=None).read_text()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| `")}
    assert rows["`cold_start_floor_ratio`"].endswith("| <= 1.30x (**missed**) |")
    cpu = rows["`cold_start_cpu_ratio`"]
    assert "1.41x" in cpu
    assert "`cold_start_cpu_s` 82.0 s; `cold_start_floor_cpu_s` 58.0 s; `cold_start_cpu_ray_s` 7.50 s" in cpu
    assert "`cold_start_cpu_serve_s` 8.00 s; `cold_start_cpu_replicas_s` 4.70 s" in cpu
    assert "`cold_start_floor_cpu_workers_s` 54.0 s; `cold_start_machine_busy_fraction` 0.910" in cpu
    assert "## Other figures" not in text  # every cold-start figure is in its section


def served_results() -> dict:
    """A run's figures of the served path against its floors (bench.floor_runs.figures of
    the records tests/unit/test_bench_floor_runs.py builds), with the targets bench.run sets."""
    from bench.floor_runs import Settings, figures
    from bench.run import targets_of
    from tests.unit.test_bench_floor_runs import runs

    results = {"machine": "2 cores, x86_64", "when": "now", **figures(*runs()),
               "load_generator": Settings(2, 5.0, 8.0, 2.0, 3.0).figures()}
    results["targets"] = targets_of(results)
    return results


def test_the_served_path_against_its_floors_shows_each_ratio_its_figures_and_the_load_generator(tmp_path):
    results = served_results()
    text = report.write_benchmarks_page(results, tmp_path / "benchmarks.md", results_dir=None).read_text()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| `")}
    p50 = rows["`add_p50_floor_ratio_haproxy`"]
    assert "| 1.00x |" in p50 and p50.endswith("| <= 1.00x (met) |")
    assert "`add_lone_p50_ms_haproxy` 11.0 ms; `add_lone_p99_ms_haproxy` 33.0 ms; `add_floor_lone_p50_ms` 11.0 ms" in p50
    assert rows["`add_p50_floor_ratio_serve_proxy`"].endswith("| <= 1.50x (met) |")
    assert rows["`add_rps_floor_ratio_haproxy`"].endswith("| >= 1.00x (**missed**) |")
    assert "`add_rps_32_haproxy` 84.0; `add_floor_rps_32` 105" in rows["`add_rps_floor_ratio_haproxy`"]
    path = rows["`infer_path_cpu_ratio_haproxy`"]
    assert "1.33x" in path and path.endswith("| <= 1.00x (**missed**) |")
    assert "`infer_path_cpu_ms_haproxy` 12.0 ms; `infer_floor_plain_path_cpu_ms` 9.00 ms" in path
    assert "`infer_front_cpu_ms_haproxy` 9.00 ms; `infer_floor_plain_front_cpu_ms` 7.00 ms" in path
    assert rows["`infer_rank_cpu_ratio_serve_proxy`"].endswith("| <= 1.00x (**missed**) |")
    assert rows["`infer_batched_cpu_ratio_haproxy`"].endswith("| <= 0.700x (met) |")
    assert "`client_scaling_rps` [100, 98.0]" in rows["`client_scaling_ratio`"]
    # the load generator's settings, the scaling table, each served figure against both floors, CPU by role
    assert "closed-loop clients over 2 client processes" in text and "windows of 8.00 s" in text
    assert "| 4 | 98.0 |" in text
    served = next(line for line in text.splitlines() if line.startswith("| unbatched `mlp_unbatched`, HAProxy"))
    assert "| 140 ms (1.12x plain, 1.40x compiled) |" in served and "| 7.00 (0.875x plain, 0.700x compiled) |" in served
    floor = next(line for line in text.splitlines() if line.startswith("| floor: app over one actor, plain calls"))
    assert floor.startswith("| floor: app over one actor, plain calls | 125 ms | 250 ms | 8.00 | 8.00 |")
    cpu = [line for line in text.splitlines() if line.startswith("| batched `mlp`, Serve's proxy")][-1]
    assert cpu == "| batched `mlp`, Serve's proxy (plain `serve run`) | 57.0 ms | 45.0 ms | 12.0 ms | 9.00 ms | " \
                  "1.00 ms | 0.500 ms | 1.50 ms | 0.0 ms |"
    assert "## Other figures" not in text  # every figure of these runs is in a table


def test_a_gpu_run_shows_its_targets_and_the_floors_tables(tmp_path):
    from bench.gpu import gpu_targets

    infer = {k: v for k, v in served_results().items() if k != "targets"}
    infer.update(gpu_targets(infer))
    gpu = {"machine": {"cuda": "NVIDIA H200", "cpus": 16}, "targets": infer.pop("targets"),
           "infer": {**infer, "cold_start_s": 50.0}}
    (tmp_path / "gpu.json").write_text(json.dumps(gpu))
    text = report.write_benchmarks_page({}, tmp_path / "benchmarks.md", results_dir=tmp_path).read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `gpu_infer_p50_floor_ratio_haproxy`"))
    assert "| 1.12x |" in row and row.endswith("| <= 1.00x (**missed**) |")
    row = next(line for line in text.splitlines() if line.startswith("| `gpu_batched_rps_floor_ratio_serve_proxy`"))
    assert "| 1.67x |" in row and row.endswith("| >= 1.00x (met) |")
    assert "### Inference: the service against both floors" in text and "| `cold_start_s` | 50.0 s |" in text


@pytest.mark.parametrize(
    ("key", "unit"),
    [
        ("infer_batched_cpu_ms_16_haproxy", "ms"),  # a client count and a path after the unit
        ("add_p50_floor_ratio_serve_proxy", "x"),
        ("infer_lone_p50_ms_vs_compiled_haproxy", "x"),  # a served figure over a floor's
        ("batched_vs_unbatched_max_rel_err", ""),
        ("add_rps_32_haproxy", ""),
        ("cold_start_s", "s"),
    ],
)
def test_a_figures_unit_is_read_past_its_path_and_client_count(key, unit):
    from bench.report_format import unit_of

    assert unit_of(key) == unit


def test_a_figure_without_a_value_misses_its_target_and_shows_no_number(tmp_path):
    from bench.run import targets_of

    results = {"machine": "2 cores", "when": "now", "infer_path_cpu_ratio_haproxy": None,
               "infer_path_cpu_ms_haproxy": 12.0, "infer_floor_plain_path_cpu_ms": -1.0, "one_to_all_ratio": 1.0}
    targets = targets_of(results)
    assert targets["infer_path_cpu_ratio_haproxy"]["met"] is False
    assert targets["infer_path_cpu_ratio_haproxy"]["value"] is None and targets["infer_path_cpu_ratio_haproxy"]["raw"] == ""
    assert targets["one_to_all_ratio"]["met"] is True
    text = report.write_benchmarks_page({**results, "targets": targets}, tmp_path / "b.md", results_dir=None).read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `infer_path_cpu_ratio_haproxy`"))
    assert "| n/a |" in row and row.endswith("| <= 1.00x (**missed**) |")
