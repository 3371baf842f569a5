"""examples/run_verl_tests.py's staging: verl's imports rewritten by the issue's table, and
nothing else in the tests changed."""

from __future__ import annotations

from examples.run_verl_tests import leftover_verl_imports, rewrite, stage

VERL_SOURCE = """\
import verl.single_controller.base.decorator as decorator_module
from verl import DataProto
from verl.protocol import DataProto, DataProtoFuture
from verl.single_controller.ray.base import RayWorkerGroup
from verl.utils.ray_utils import parallel_put
from verl.models.llama import Model
"""


def test_rewrite_applies_the_import_table():
    out = rewrite(VERL_SOURCE).splitlines()
    assert out[0] == "import single_controller.base.decorator as decorator_module"
    assert out[1] == "from single_controller import DataProto"
    assert out[2] == "from single_controller.protocol import DataProto, DataProtoFuture"
    assert out[3] == "from single_controller.ray.base import RayWorkerGroup"
    assert out[4] == "from single_controller.ray.transfer import parallel_put"
    assert out[5] == "from verl.models.llama import Model"  # outside the table: left as it is


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
