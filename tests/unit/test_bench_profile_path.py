"""bench.profile_path without a service: the targets it starts, the py-spy command it
runs, and how it sums py-spy's samples."""

from __future__ import annotations

import json
from pathlib import Path

from bench.profile_path import ECHO, INFER, py_spy_command, summarize, target


def test_py_spy_samples_the_gils_holder_unless_every_thread_is_asked_for(tmp_path):
    raw = tmp_path / "samples.txt"
    command = py_spy_command("py-spy", 4321, 20.0, raw)
    assert command[:2] == ["py-spy", "record"] and "--gil" in command
    assert command[command.index("--pid") + 1] == "4321" and command[command.index("--duration") + 1] == "20"
    assert command[command.index("--output") + 1] == str(raw) and "--nonblocking" in command
    assert "--gil" not in py_spy_command("py-spy", 4321, 20.0, raw, all_threads=True)


def test_echo_sends_the_inference_body_to_the_echo_model_of_test_actor_alone():
    proc, path, body, headers = target("echo")
    assert path == ECHO == "/v2/models/echo/infer" and proc.deployments == ["test_actor"]
    _, infer_path, infer_body, infer_headers = target("infer")
    assert infer_path == INFER and headers == infer_headers and len(body) == len(infer_body)
    header_length = int(headers["Inference-Header-Content-Length"])
    (tensor,) = json.loads(body[:header_length])["inputs"]
    assert tensor["shape"] == [8, 2, 4096] and len(body) - header_length == 8 * 2 * 4096 * 4


def test_samples_are_summed_by_part_and_idle_waits_left_out(tmp_path):
    raw = Path(tmp_path) / "samples.txt"
    raw.write_text(
        "main (x.py:1);infer (hybridflow/http/routes/oip.py:80) 6\n"
        "main (x.py:1);_submit (single_controller/ray/worker_group.py:354) 2\n"
        "main (x.py:1);select (selectors.py:468) 50\n"
        "main (x.py:1);__call__ (starlette/routing.py:10) 2\n"
    )
    report = summarize(raw, top=5)
    assert "busy samples: 10" in report
    assert "60.0%  hybridflow.http (routes, bodies, answers)" in report
    assert "20.0%  single_controller (dispatch, collect)" in report
    assert "20.0%  Starlette and FastAPI" in report
    assert "selectors" not in report
