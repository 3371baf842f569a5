"""Which bodies leave the event loop: work counted in parsed bytes, raw tensor bytes at a
sixteenth of one (hybridflow.wire.loop_work), for the OIP route's requests and answers."""

from __future__ import annotations

import torch

from hybridflow.http.oip import answer_work, request_work
from hybridflow.wire.loop_work import OFF_LOOP_BYTES, RAW_BYTES_PER_PARSED_BYTE, leaves_loop, loop_work


def test_raw_bytes_count_a_sixteenth_of_parsed_ones():
    assert loop_work(100, 160) == 110
    assert not leaves_loop(OFF_LOOP_BYTES - 1) and leaves_loop(OFF_LOOP_BYTES)
    assert leaves_loop(loop_work(0, OFF_LOOP_BYTES * RAW_BYTES_PER_PARSED_BYTE))


def test_a_binary_request_is_its_header_parsed_and_its_tensor_bytes_raw():
    body = bytearray(200) + bytearray(8 * 2 * 4096 * 4)  # a 200-byte header, then [8, 2, 4096] FP32
    assert request_work(body, "200") == 200 + 8 * 2 * 4096 * 4 // RAW_BYTES_PER_PARSED_BYTE
    assert not leaves_loop(request_work(body, "200"))  # the tensor is a view: decoded on the loop
    assert leaves_loop(request_work(body, None))  # the same bytes as JSON are parsed: off the loop


def test_a_header_length_that_is_no_length_counts_the_body_as_json():
    body = bytearray(1000)
    assert request_work(body, "-5") == request_work(body, "x") == request_work(body, None) == 1000
    assert request_work(body, "5000") == 1000  # past the body: what is there, never the claim


def test_an_answer_is_its_json_outputs_parsed_and_its_binary_outputs_raw():
    outputs = {"y": torch.zeros(8, 2, 4096), "z": torch.zeros(10, dtype=torch.float64), "note": "x"}
    raw = 8 * 2 * 4096 * 4
    assert answer_work(outputs, {"y"}) == 80 + raw // RAW_BYTES_PER_PARSED_BYTE
    assert answer_work(outputs, set()) == 80 + raw
    assert not leaves_loop(answer_work(outputs, {"y"})) and leaves_loop(answer_work(outputs, set()))
