"""A second process for tests/unit/test_state_store.py: writes to a state store given by
its location, so the tests can run writers side by side and SIGKILL one mid-write.

    python -m tests.unit.state_store_child write LOCATION NAMESPACE SCOPE FIRST STEP COUNT
    python -m tests.unit.state_store_child until-killed LOCATION NAMESPACE SCOPE ENTRY_BYTES

``write`` records COUNT calls numbered FIRST, FIRST+STEP, ... (each with an idempotency
answer). ``until-killed`` records calls 1, 2, ... with a snapshot every
:data:`SNAPSHOT_EVERY` calls, forever, printing ``call N`` / ``snapshot N`` once each has
returned (acknowledged), for the parent to kill it at any point (snapshots of 4 parts).
"""

from __future__ import annotations

import hashlib
import sys

from hybridflow.state import store as state_store
from hybridflow.state.backends import open_store
from hybridflow.state.store import StoredAnswer

SNAPSHOT_EVERY = 25


def payload(label: str, seq: int, size: int) -> bytes:
    """Bytes that can only be the ones written for (label, seq): a torn or mixed-up
    record never equals them."""
    block = hashlib.sha256(f"{label}:{seq}".encode()).digest()
    return (block * (size // len(block) + 1))[:size]


def answer_for(seq: int) -> StoredAnswer:
    return StoredAnswer(f"key-{seq}", f"fp-{seq}", payload("answer", seq, 64))


def main(argv: list[str]) -> None:
    mode, location, namespace, scope = argv[:4]
    store = open_store(location, namespace=namespace)
    if mode == "write":
        first, step, count = (int(value) for value in argv[4:7])
        for seq in range(first, first + step * count, step):
            store.record_call(scope, seq, payload("entry", seq, 256), answer_for(seq))
        print("done", flush=True)
    elif mode == "until-killed":
        size = int(argv[4])
        state_store.SNAPSHOT_PART_BYTES = size  # a snapshot is 4 parts: a kill may land between them
        seq = 0
        while True:
            seq += 1
            store.record_call(scope, seq, payload("entry", seq, size), answer_for(seq))
            print(f"call {seq}", flush=True)
            if seq % SNAPSHOT_EVERY == 0:
                store.store_snapshot(scope, seq, payload("snapshot", seq, 4 * size))
                print(f"snapshot {seq}", flush=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
