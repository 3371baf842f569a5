"""megatron.core imported with torch.compile deferred: the stand-in compiles each function
once, on its first call, with the options it was given; the import leaves TorchDynamo
unimported and torch.compile as it was (in a fresh interpreter, since imports are
process-wide)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from single_controller.megatron.core_import import deferred_compile

ROOT = Path(__file__).resolve().parents[2]


class RecordingCompiler:
    """A compile function that records its calls and returns a function doubling the
    original's answer, so a test sees which one ran."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, dict]] = []

    def __call__(self, model, **options):
        self.calls.append((model, options))
        if callable(model) and not isinstance(model, Box):
            return lambda *args, **kwargs: 2 * model(*args, **kwargs)
        return ("compiled", model)


class Box:
    """Not a plain function (as an nn.Module is not)."""


def square(x):
    """x squared."""
    return x * x


def test_a_decorated_function_compiles_on_its_first_call_only():
    compiler = RecordingCompiler()
    deferred = deferred_compile(compiler)
    wrapped = deferred(square, dynamic=False)
    assert compiler.calls == []
    assert wrapped.__name__ == "square" and wrapped.__doc__ == "x squared."
    assert wrapped(3) == 18  # the compiled function answered
    assert wrapped(4) == 32
    assert compiler.calls == [(square, {"dynamic": False})]


def test_the_decorator_form_keeps_its_options():
    compiler = RecordingCompiler()

    @deferred_compile(compiler)(fullgraph=True)
    def cube(x):
        return x ** 3

    assert compiler.calls == []
    assert cube(2) == 16
    assert [options for _, options in compiler.calls] == [{"fullgraph": True}]


def test_anything_but_a_plain_function_is_compiled_at_once():
    compiler = RecordingCompiler()
    box = Box()
    assert deferred_compile(compiler)(box, mode="default") == ("compiled", box)
    assert compiler.calls == [(box, {"mode": "default"})]


SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    original = torch.compile
    from single_controller.megatron.core_import import import_megatron_core
    core = import_megatron_core()
    from megatron.core import jit, parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear
    print(json.dumps({
        "dynamo_imported": "torch._dynamo" in sys.modules,
        "compile_restored": torch.compile is original,
        "fuser_deferred": jit.jit_fuser is not original,
        "same_module": core is sys.modules["megatron.core"] and import_megatron_core() is core,
        "parallel_state": hasattr(parallel_state, "initialize_model_parallel"),
    }))
    """
)


def test_megatron_core_imports_without_dynamo_and_leaves_torch_compile_alone():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"dynamo_imported": False, "compile_restored": True, "fuser_deferred": True,
                    "same_module": True, "parallel_state": True}
