"""The rendezvous port a group's rank 0 listens on: drawn outside the kernel's ephemeral
range, so that no outgoing connection can take it between the pick and the listen."""

from __future__ import annotations

import socket

from single_controller import rendezvous
from single_controller.rendezvous import RENDEZVOUS_PORT_LOW, rendezvous_port


def test_the_port_is_free_and_below_the_ephemeral_range():
    high = rendezvous._ephemeral_low()
    for _ in range(20):
        port = rendezvous_port()
        assert RENDEZVOUS_PORT_LOW <= port < high
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", port))  # free now


def test_a_port_in_use_is_skipped(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("", 0))
        held.listen()
        taken = held.getsockname()[1]
        draws = iter([taken, taken, 23456])
        monkeypatch.setattr(rendezvous, "_ephemeral_low", lambda: 65536)
        monkeypatch.setattr(rendezvous.random, "randrange", lambda low, high: next(draws))
        assert rendezvous_port() == 23456


def test_without_room_below_the_ephemeral_range_any_free_port_is_taken(monkeypatch):
    monkeypatch.setattr(rendezvous, "_ephemeral_low", lambda: RENDEZVOUS_PORT_LOW + 10)
    monkeypatch.setattr(rendezvous, "free_port", lambda: 61000)
    assert rendezvous_port() == 61000
