"""The shared gloo device: groups made after ``share_gloo_device`` add their worker
threads and no transport loop of their own, and still reduce correctly. Each case runs in
a fresh interpreter, since sharing is process-wide."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist
    from single_controller.gloo_device import share_gloo_device

    def threads():
        return len(os.listdir(f"/proc/{os.getpid()}/task"))

    if sys.argv[1] == "shared":
        assert share_gloo_device() and share_gloo_device()  # the second call does nothing
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=0, world_size=1)
    before = threads()
    groups = [dist.new_group([0]) for _ in range(4)]
    added = threads() - before
    sums = []
    for group in groups:
        tensor = torch.arange(3.0)
        dist.all_reduce(tensor, group=group)
        sums.append(tensor.sum().item())
    workers = groups[0]._get_backend(torch.device("cpu")).options._threads
    print(json.dumps({"added": added, "workers": workers, "sums": sums}))
    dist.destroy_process_group()  # every group: a clean exit, the shared device released at exit
    """
)


def _run(mode: str, tmp_path: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode, str(tmp_path / f"rendezvous-{mode}")],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc")
def test_groups_on_the_shared_device_start_no_transport_loop_of_their_own(tmp_path):
    own, shared = _run("own", tmp_path), _run("shared", tmp_path)
    # torch's default: each group's worker threads plus its device's loop thread
    assert own["added"] == 4 * (own["workers"] + 1), own
    assert shared["added"] == 4 * shared["workers"], shared
    assert own["sums"] == shared["sums"] == [3.0] * 4
