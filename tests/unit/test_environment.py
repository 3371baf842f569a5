"""One environment prefix, HYBRIDFLOW_: each earlier SC_ name is still read for one
release, with a warning naming its replacement, and never over the new one."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hybridflow.config import StateConfig, load_config
from hybridflow.config.environment import RENAMED, setting
from tests.unit.test_client_install import CLIENT

ARGS = {"deployments": [{"name": "d", "groups": [
    {"name": "acc", "worker": "single_controller.models.tutorial_workers:Accumulator", "plain_actor": True}]}]}


def test_every_name_has_the_one_prefix_and_its_earlier_one():
    assert all(new.startswith("HYBRIDFLOW_") and old.startswith("SC_") for new, old in RENAMED.items())
    assert {"HYBRIDFLOW_TOKEN", "HYBRIDFLOW_STATE_PATH", "HYBRIDFLOW_STATE_FRESH"} <= set(RENAMED)


def test_the_new_name_wins_and_the_earlier_one_is_read_with_a_warning():
    assert setting("HYBRIDFLOW_STATE_PATH", {"HYBRIDFLOW_STATE_PATH": "new.db", "SC_STATE_PATH": "old.db"}) == "new.db"
    with pytest.warns(FutureWarning, match="SC_STATE_PATH .* set HYBRIDFLOW_STATE_PATH instead"):
        assert setting("HYBRIDFLOW_STATE_PATH", {"SC_STATE_PATH": "old.db"}) == "old.db"
    assert setting("HYBRIDFLOW_STATE_PATH", {}) is None


def test_the_service_reads_its_token_and_state_under_either_name(monkeypatch, tmp_path):
    monkeypatch.delenv("HYBRIDFLOW_TOKEN", raising=False)
    monkeypatch.setenv("SC_AUTH_TOKEN", "earlier")
    with pytest.warns(FutureWarning, match="HYBRIDFLOW_TOKEN"):
        assert load_config(ARGS).auth_token == "earlier"
    monkeypatch.setenv("HYBRIDFLOW_TOKEN", "current")
    assert load_config(ARGS).auth_token == "current"
    with pytest.warns(FutureWarning):
        fresh = StateConfig(path="s.db").resolved(env={"SC_STATE_FRESH": "1"}, cwd=tmp_path)
    assert fresh.fresh and fresh.path == str(tmp_path / "s.db")


@pytest.mark.parametrize(("env", "warned"), [
    ({"HYBRIDFLOW_URL": "http://new:1", "SC_URL": "http://old:1"}, False),
    ({"SC_URL": "http://old:1"}, True),
])
def test_the_command_line_reads_its_url_under_either_name(env, warned):
    code = "from hybridflow_client import cli; print(cli.build_parser().parse_args(['groups']).url)"
    done = subprocess.run([sys.executable, "-c", code], cwd=CLIENT, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", **env})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("http://old:1" if warned else "http://new:1")
    assert ("set HYBRIDFLOW_URL instead" in done.stderr) == warned
