"""examples/run_verl_tests.py's staging: verl's imports rewritten by the import table and
nothing else in the tests changed; a ref's tests read from git without checking it out;
each ref's expectations chosen by its commit and covering every file of its tests."""

from __future__ import annotations

import subprocess

import pytest

from examples.run_verl_tests import (
    ABORTS,
    BASICS,
    PROFILES,
    choose_profile,
    export_ref,
    leftover_verl_imports,
    list_test_files,
    plan,
    resolve_commit,
    rewrite,
    stage,
)

VERL_SOURCE = """\
import verl.single_controller.base.decorator as decorator_module
from verl import DataProto
from verl.protocol import DataProto, DataProtoFuture
from verl.single_controller.ray.base import RayWorkerGroup, split_resource_pool
from verl.utils.ray_utils import parallel_put
from verl.models.llama import Model
from verl.utils.device import get_device_name, get_nccl_backend
from verl.utils import tensordict_utils as tu
import verl.utils.tensordict_utils as tu
"""


def test_rewrite_applies_the_import_table():
    out = rewrite(VERL_SOURCE).splitlines()
    assert out[0] == "import single_controller.base.decorator as decorator_module"
    assert out[1] == "from single_controller import DataProto"
    assert out[2] == "from single_controller.protocol import DataProto, DataProtoFuture"
    assert out[3] == "from single_controller.ray.base import RayWorkerGroup, split_resource_pool"
    assert out[4] == "from single_controller.ray.transfer import parallel_put"
    assert out[5] == "from verl.models.llama import Model"  # outside the table: left as it is
    assert out[6] == "from single_controller.device import get_device_name, get_nccl_backend"
    assert out[7] == "from single_controller import tensordict_utils as tu"
    assert out[8] == "import single_controller.tensordict_utils as tu"


def test_stage_copies_outside_the_checkout_and_reports_what_still_needs_verl(tmp_path):
    tests = tmp_path / "verl" / "tests" / "single_controller"
    (tests / "base").mkdir(parents=True)
    (tests / "test_a.py").write_text(VERL_SOURCE)
    (tests / "base" / "test_b.py").write_text("from verl.single_controller.base import Worker\n")
    work = tmp_path / "work"
    work.mkdir()
    staged = stage(tmp_path / "verl", work)
    assert (staged / "base" / "test_b.py").read_text() == "from single_controller.base import Worker\n"
    assert leftover_verl_imports(staged / "test_a.py") == ["from verl.models.llama import Model"]
    assert (tests / "test_a.py").read_text() == VERL_SOURCE  # the checkout is untouched
    assert "num_gpus" in (work / "_local_ray_cluster.py").read_text()


def git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_a_refs_tests_are_read_from_git_and_its_profile_chosen_by_commit(tmp_path):
    repo = tmp_path / "verl"
    (repo / "tests" / "single_controller").mkdir(parents=True)
    (repo / "verl" / "version").mkdir(parents=True)
    (repo / "verl" / "version" / "version").write_text("0.4.1\n")
    (repo / "tests" / "single_controller" / "test_old.py").write_text("OLD\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    git(repo, "tag", "first")
    (repo / "tests" / "single_controller" / "test_old.py").write_text("NEW\n")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "two")
    out = export_ref(repo, "first", tmp_path / "export")
    assert (out / "tests" / "single_controller" / "test_old.py").read_text() == "OLD\n"
    commit = resolve_commit(repo, "first")
    assert len(commit) == 40
    profile, why = choose_profile(commit, "0.4.1", None)  # unknown commit: the version file decides
    assert profile.name == "v0.4.1" and "version file" in why
    assert choose_profile(PROFILES[1].commit, "anything", None)[0].name == "v0.7.0"
    assert choose_profile(None, "x", "b178a3cd")[0].name == "b178a3cd"
    with pytest.raises(SystemExit, match="no expectations"):
        choose_profile(commit, "9.9", None)
    assert resolve_commit(tmp_path / "export", None) is None  # a plain source tree


V07_TREE = [
    "base/test_decorator.py", "check_worker_alive/", "detached_worker/", "test_auto_padding_on_cpu.py",
    "test_colocated_workers.py", "test_colocated_workers_fused.py", "test_data_transfer.py",
    "test_decorator_on_cpu.py", "test_device_mesh_register.py", "test_driverfunc_to_worker.py",
    "test_fused_workers_on_cpu.py", "test_get_set_dispatch_collect_cpu.py", "test_high_level_scheduling_api.py",
    "test_nested_worker.py", "test_ray_collectives.py", "test_ray_local_envs_on_cpu.py",
    "test_ray_utils_on_cpu.py", "test_rvdz.py", "test_split_resource_pool.py", "test_worker_group_basics.py",
    "test_worker_group_torch.py",
]


def test_every_file_of_a_ref_has_an_expectation(tmp_path):
    tests = tmp_path / "tests"
    for rel in V07_TREE:
        path = tests / rel
        if rel.endswith("/"):
            path.mkdir(parents=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")
    assert list_test_files(tests) == V07_TREE
    by_name = {p.name: p for p in PROFILES}
    for name in ("v0.7.0", "b178a3cd"):
        wanted, unknown = plan(by_name[name], V07_TREE)
        assert unknown == [] and wanted[-1] == ABORTS
    wanted, _ = plan(by_name["b178a3cd"], V07_TREE)
    assert {"test_split_resource_pool.py", "test_device_mesh_register.py", "test_worker_group_torch.py", BASICS} <= set(
        wanted
    )
    _, unknown = plan(by_name["v0.4.1"], [*V07_TREE, "test_brand_new.py"])
    assert "test_brand_new.py" in unknown  # a file no expectation covers fails the run


def test_the_cluster_plugin_starts_a_local_cluster_again_when_a_start_times_out(tmp_path, monkeypatch):
    import importlib.util
    import sys
    import types

    from examples.run_verl_tests import LOCAL_CLUSTER_PLUGIN, RESTART_LOG_ENV

    calls, shutdowns, failures = [], [], [2]

    def fake_init(address=None, **kwargs):
        calls.append((address, kwargs))
        if failures[0] > 0:
            failures[0] -= 1
            raise Exception("The current node timed out during startup. ...")
        return "started"

    fake_ray = types.SimpleNamespace(init=fake_init, shutdown=lambda: shutdowns.append(1))
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    monkeypatch.setenv(RESTART_LOG_ENV, str(tmp_path / "restarts.txt"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    plugin = tmp_path / "plugin.py"
    plugin.write_text(LOCAL_CLUSTER_PLUGIN)
    spec = importlib.util.spec_from_file_location("local_cluster_plugin", plugin)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert fake_ray.init(num_cpus=100) == "started"
    assert calls[-1] == ("local", {"num_cpus": 100, "num_gpus": 8, "include_dashboard": False})
    assert len(shutdowns) == 2 and (tmp_path / "restarts.txt").read_text().split() == ["restart", "restart"]
    failures[0] = 3
    with pytest.raises(Exception, match="timed out"):  # after three starts it gives up
        fake_ray.init()
