"""bench.load_generator against a real HTTP server over loopback (tests/unit/load_target.py,
uvicorn in a thread): what it counts against what the server answered, the split of the
clients over processes, errors, chunked and closing answers, and its command line. No
timing assertions: the figures are checked for consistency, not speed."""

from __future__ import annotations

import json

import httpx
import pytest

from bench.load_generator import Load, main, percentile, run_load
from tests.unit import load_target
from tests.unit.served_app import served


@pytest.fixture(scope="module")
def url():
    with served(load_target.app) as base:
        yield base


def counts(url: str) -> dict[str, int]:
    return httpx.get(f"{url}/counts").json()


def test_the_concurrency_is_spread_over_the_processes_as_evenly_as_it_goes():
    assert Load("http://h:1", "/", concurrency=32, processes=3).split() == [11, 11, 10]
    assert Load("http://h:1", "/", concurrency=2, processes=4).split() == [1, 1]  # no process without a client
    assert Load("http://h:1", "/", concurrency=16, processes=2).split() == [8, 8]
    with pytest.raises(ValueError, match="at least 1"):
        Load("http://h:1", "/", concurrency=0, processes=2).split()


def test_the_request_is_built_once_with_its_length_and_headers():
    load = Load.of_json("http://127.0.0.1:8000", "/v1/groups/g/add", {"kwargs": {"x": 1}})
    head, body = load.request_bytes().split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /v1/groups/g/add HTTP/1.1"
    assert "Host: 127.0.0.1:8000" in lines and "Content-Type: application/json" in lines
    assert f"Content-Length: {len(body)}" in lines and json.loads(body) == {"kwargs": {"x": 1}}
    with pytest.raises(ValueError, match="http://host:port"):
        Load("https://127.0.0.1:8000", "/").request_bytes()


def test_percentiles_interpolate_between_samples():
    samples = [1.0, 2.0, 3.0, 4.0]
    assert percentile(samples, 0.5) == 2.5
    assert percentile(samples, 0.99) == pytest.approx(3.97)
    assert percentile([5.0], 0.99) == 5.0
    with pytest.raises(ValueError):
        percentile([], 0.5)


def test_every_request_sent_is_answered_and_counted_once(url):
    before = counts(url)["count"]
    load = Load.of_json(url, "/count", {"x": 1}, concurrency=6, processes=3, warmup_s=0.2, window_s=1.0)
    result = run_load(load)
    served_now = counts(url)["count"] - before
    # the requests in flight at the window's end are awaited: what was answered is what was served
    assert result.answered_total == served_now
    assert result.errors == result.errors_total == 0 and result.error_samples == []
    assert result.clients_per_process == [2, 2, 2] and result.processes == 3
    assert sum(result.requests_per_process) == result.requests <= result.answered_total
    assert result.requests > 0 and result.rps == pytest.approx(result.requests / result.window_s)
    assert result.p50_ms <= result.p99_ms
    assert len(result.client_cpu_s) == 3 and all(cpu >= 0 for cpu in result.client_cpu_s)
    assert result.window_end - result.window_start == pytest.approx(1.0)


def test_errors_are_counted_and_said_and_the_clients_go_on(url):
    before = counts(url)["fail"]
    result = run_load(Load.of_json(url, "/fail", {}, concurrency=4, processes=2, warmup_s=0.2, window_s=1.0))
    served_now = counts(url)["fail"]
    # the server fails its requests number 3, 6, 9, ...: as many errors as multiples of 3 it reached
    assert result.answered_total == served_now - before
    assert result.errors_total == served_now // 3 - before // 3
    assert 0 < result.errors <= result.errors_total
    assert result.requests + result.errors <= result.answered_total
    assert result.error_samples and all(s.startswith("500: ") and "every third request fails" in s
                                        for s in result.error_samples)


def test_chunked_answers_and_closed_connections_are_read(url):
    before = counts(url)
    chunked = run_load(Load.of_json(url, "/chunked", {}, concurrency=2, processes=1, warmup_s=0.1, window_s=0.5))
    closing = run_load(Load.of_json(url, "/close", {}, concurrency=2, processes=2, warmup_s=0.1, window_s=0.5))
    after = counts(url)
    assert chunked.errors_total == 0 and chunked.requests > 0
    assert chunked.answered_total == after["chunked"] - before["chunked"]
    # the server closes each connection after its answer: each client connects again
    assert closing.errors_total == 0 and closing.requests > 0
    assert closing.answered_total == after["close"] - before["close"]


def test_a_window_that_drops_its_last_requests_counts_only_what_was_answered(url):
    before = counts(url)["count"]
    result = run_load(Load.of_json(url, "/count", {}, concurrency=4, processes=2, warmup_s=0.1, window_s=0.5,
                                   drain=False))
    served_now = counts(url)["count"] - before
    assert result.errors_total == 0
    assert result.answered_total <= served_now <= result.answered_total + 4


def test_a_server_that_is_not_there_fails_the_run():
    with pytest.raises(RuntimeError, match="did not say 'ready'"):
        run_load(Load.of_json("http://127.0.0.1:9", "/count", {}, concurrency=1, processes=1))


def test_the_command_line_prints_the_result(url, capsys):
    assert main([url, "/count", "--json", '{"x": 2}', "--concurrency", "3", "--processes", "2",
                 "--warmup", "0.1", "--window", "0.5"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["concurrency"] == 3 and printed["clients_per_process"] == [2, 1]
    assert printed["requests"] > 0 and printed["errors"] == 0
    assert printed["client_cpu_total_s"] == pytest.approx(sum(printed["client_cpu_s"]))
