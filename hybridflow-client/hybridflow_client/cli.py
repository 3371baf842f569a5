"""Command-line client of the single-controller service (``hybridflow``, or
``python -m hybridflow_client.cli``).

    hybridflow health [--wait 60]
    hybridflow groups
    hybridflow group gpu_accumulator
    hybridflow call gpu_accumulator add --kwargs '{"x": [1, 1, 1, 1]}'
    hybridflow call test_actor foo --kwargs '{"y": 3}' --binary
    hybridflow call accumulator add --args '[10]'
    hybridflow infer mlp --shape 8,2,4096 --random
    hybridflow job mlp run_layer --random-input 2048,16,4096 --binary --split 16
    hybridflow events [--group gpu_accumulator] [--since 0] [--count 10]

``--url`` (default $HYBRIDFLOW_URL or http://127.0.0.1:8000), ``--token`` (default $HYBRIDFLOW_TOKEN)
and ``--timeout`` may come before or after the command. While a call or an inference
waits, a spinner with the elapsed time runs on stderr (when stderr is a terminal).

Exit status: 0 success, 1 the service answered an error (or is not ready), 2 bad usage,
3 the service could not be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import pprint
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np

from hybridflow_client.progress import ProgressLine, wait_with_progress
from hybridflow_client.python_client import (
    DEFAULT_TIMEOUT_S,
    DEFAULT_URL,
    ServiceError,
    SingleControllerClient,
)
from hybridflow_client.wire import tensors
from hybridflow_client.wire.datatypes import DATATYPES
from hybridflow_client.wire.json_values import encode_json_value
from hybridflow_client.wire.limits import CLIENT_LIMITS

__all__ = ["COMMANDS", "UsageError", "build_parser", "main", "wait_with_progress"]

PROG = "hybridflow"
EXIT_OK, EXIT_SERVICE, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3


class UsageError(Exception):
    """Arguments that argparse accepted but the command cannot use."""


def from_environment(name: str, earlier: str) -> str | None:
    """``$name``, or its earlier name's value (read for one more release, with a warning)."""
    if name in os.environ:
        return os.environ[name]
    if earlier in os.environ:
        print(f"hybridflow: {earlier} is read for one more release: set {name} instead", file=sys.stderr)
        return os.environ[earlier]
    return None


def _connection_options(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """``--url`` etc. on the main parser (with defaults) and on each command (without, so
    a value given after the command wins and one given before is kept)."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    parser.add_argument(
        "--url", default=default(from_environment("HYBRIDFLOW_URL", "SC_URL") or DEFAULT_URL),
        help=f"service address (default: $HYBRIDFLOW_URL or {DEFAULT_URL})",
    )
    parser.add_argument(
        "--token", default=default(from_environment("HYBRIDFLOW_TOKEN", "SC_AUTH_TOKEN")),
        help="bearer token (default: $HYBRIDFLOW_TOKEN)",
    )
    parser.add_argument(
        "--timeout", type=float, default=default(DEFAULT_TIMEOUT_S),
        help="seconds to wait for an answer" + ("" if suppress else " (default: %(default)s)"),
    )
    parser.add_argument("--no-progress", action="store_true", default=default(False), help="no spinner while waiting")


def _json_arg(kind: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{kind} is not valid JSON: {exc}") from None

    return parse


def _shape(text: str) -> list[int]:
    try:
        shape = [int(part) for part in text.replace("x", ",").split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} is not comma-separated integers") from None
    if not shape or any(d < 0 for d in shape):
        raise argparse.ArgumentTypeError(f"shape {text!r} needs non-negative dimensions")
    return shape


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Call worker groups of the single-controller service over HTTP."
    )
    _connection_options(parser, suppress=False)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        _connection_options(sub, suppress=True)
        return sub

    health = command("health", "liveness and readiness")
    health.add_argument("--wait", type=float, default=0.0, metavar="SECONDS", help="wait this long for readiness")

    groups = command("groups", "list the worker groups")
    groups.add_argument("--json", action="store_true", help="print the answer as JSON")

    group = command("group", "one group with per-rank details (JSON)")
    group.add_argument("name")

    call = command("call", "call a method of a group")
    call.add_argument("group")
    call.add_argument("method")
    call.add_argument(
        "--args", type=_json_arg("--args"), default=[], metavar="JSON", help="positional arguments, a JSON list"
    )
    call.add_argument(
        "--kwargs", type=_json_arg("--kwargs"), default={}, metavar="JSON",
        help='keyword arguments, a JSON object, e.g. \'{"x": [1, 1, 1, 1]}\'; tensors as '
        '{"datatype": "FP32", "shape": [2], "data": [1, 2]}',
    )
    call.add_argument(
        "--binary", action="store_true",
        help="send kwargs as safetensors (numbers and lists of numbers become tensors) and get the output back "
        "as safetensors",
    )
    call.add_argument("--idempotency-key", metavar="KEY", help="sent as Idempotency-Key")
    call.add_argument("--json", action="store_true", help="print the output as JSON (tensors as tensor objects)")

    job = command("job", "run a call as a job: submit, show a progress bar until it finishes, print the result")
    job.add_argument("group")
    job.add_argument("method")
    job.add_argument("--args", type=_json_arg("--args"), default=[], metavar="JSON", help="positional arguments")
    job.add_argument("--kwargs", type=_json_arg("--kwargs"), default={}, metavar="JSON", help="keyword arguments")
    job.add_argument(
        "--random-input", type=_shape, metavar="SHAPE",
        help="add a uniform random FP32 tensor of this shape as keyword x=[tensor] (one dp rank), "
        "e.g. 2048,16,4096 for the tutorial's full MLP call",
    )
    job.add_argument("--binary", action="store_true", help="send and receive safetensors")
    job.add_argument("--split", type=int, default=1, help="pieces along dim 0 of the dp input (progress steps)")
    job.add_argument("--json", action="store_true", help="print the output as JSON")

    events = command("events", "print the service's events as they happen (GET /v1/events), until interrupted")
    events.add_argument("--group", help="only this group's events")
    events.add_argument("--since", metavar="ID", help="start after this event id (0: every event the service kept)")
    events.add_argument("--count", type=int, metavar="N", help="stop after N events")
    events.add_argument("--json", action="store_true", help="one JSON object per line: id, event and data")

    infer = command("infer", "Open Inference Protocol inference with binary tensor data")
    infer.add_argument("model")
    infer.add_argument("--shape", type=_shape, help="input shape, e.g. 8,2,64 (default: the model's, -1 as 1)")
    infer.add_argument("--random", action="store_true", help="uniform random input in [0, 1) (default: ones)")
    infer.add_argument("--seed", type=int, default=0, help="seed for --random (numpy's generator)")
    infer.add_argument(
        "--datatype", choices=sorted(DATATYPES), help="input datatype (default: the model's, or FP32)"
    )
    infer.add_argument("--input", dest="input_name", help="input name (default: the model's first input)")
    infer.add_argument("--output", dest="output_name", help="output to ask for (default: all)")
    infer.add_argument("--json-data", action="store_true", help="send and receive JSON data instead of binary")
    return parser


def _print_output(output: Any, as_json: bool) -> None:
    if as_json:
        print(json.dumps(encode_json_value(output, CLIENT_LIMITS), indent=2))
    elif tensors.is_tensor(output):
        print(output)
    else:
        print(pprint.pformat(output, width=100, sort_dicts=False))


def _cmd_health(client: SingleControllerClient, args: argparse.Namespace) -> int:
    client.health()  # raises ServiceError unless live
    print("live: yes")
    ready = client.wait_ready(timeout=args.wait, interval=1.0) if args.wait > 0 else client.ready()
    print(f"ready: {'yes' if ready else 'no'}")
    return EXIT_OK if ready else EXIT_SERVICE


def _cmd_groups(client: SingleControllerClient, args: argparse.Namespace) -> int:
    groups = client.groups()
    if args.json:
        print(json.dumps(groups, indent=2))
        return EXIT_OK
    rows = [("GROUP", "WORLD", "STATUS", "RESOURCE POOL", "METHODS")]
    for group in groups:
        methods = ", ".join(
            f"{m['name']}({m.get('dispatch_mode', '?')})" if isinstance(m, dict) else str(m)
            for m in group.get("methods", [])
        )
        cells = (group.get(key, "") for key in ("name", "world_size", "status", "resource_pool"))
        rows.append((*(str(cell) for cell in cells), methods))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)) + "  " + row[4])
    return EXIT_OK


def _cmd_group(client: SingleControllerClient, args: argparse.Namespace) -> int:
    print(json.dumps(client.group(args.name), indent=2))
    return EXIT_OK


def _cmd_call(client: SingleControllerClient, args: argparse.Namespace) -> int:
    if not isinstance(args.args, list):
        raise UsageError("--args must be a JSON list")
    if not isinstance(args.kwargs, dict):
        raise UsageError("--kwargs must be a JSON object")
    if args.binary and args.args:
        raise UsageError("--binary sends keyword arguments only; use --kwargs")
    started = time.monotonic()
    result = wait_with_progress(
        f"{args.group}.{args.method}",
        lambda: client.call_with(
            args.group, args.method, args.args, args.kwargs, binary=args.binary, full=True,
            idempotency_key=args.idempotency_key,
        ),
        enabled=not args.no_progress,
    )
    details = [f"{time.monotonic() - started:.3f} s"]
    if result.get("dispatch_mode"):
        details.insert(
            0, f"{result['dispatch_mode']}/{result.get('execute_mode')}, world size {result.get('world_size')}"
        )
    print(f"# {args.group}.{args.method}: {'; '.join(details)}", file=sys.stderr)
    _print_output(result["output"], args.json)
    return EXIT_OK


def _model_input(client: SingleControllerClient, args: argparse.Namespace) -> tuple[str, str, list[int]]:
    name, datatype, shape = args.input_name, args.datatype, args.shape
    if name is None or datatype is None or shape is None:
        declared: dict[str, Any] = {}
        try:
            inputs = client.model_metadata(args.model).get("inputs") or []
            declared = next((i for i in inputs if name is None or i.get("name") == name), {})
        except ServiceError as exc:
            if shape is None:
                raise
            print(f"# no model metadata ({exc}); using defaults", file=sys.stderr)
        name = name or declared.get("name", "x")
        datatype = datatype or declared.get("datatype", "FP32")
        if shape is None:
            if "shape" not in declared:
                raise UsageError(f"model {args.model!r} declares no input shape; pass --shape")
            shape = [1 if d < 0 else d for d in declared["shape"]]
    return name, datatype, shape


def make_input(datatype: str, shape: list[int], random: bool = False, seed: int = 0) -> Any:
    """An input of ``datatype`` and ``shape``: ones, or uniform random values ([0, 1) for
    floats, 0..99 for integers, 0/1 for BOOL). BF16 needs torch (a torch tensor is made)."""
    generator = np.random.default_rng(seed)
    if datatype not in DATATYPES:
        raise UsageError(f"unknown datatype {datatype!r}; use one of {', '.join(DATATYPES)}")
    floating = datatype.startswith(("FP", "BF"))
    if random and floating:
        values = generator.random(shape, dtype=np.float32)
    elif random:
        values = generator.integers(0, 2 if datatype == "BOOL" else 100, shape)
    else:
        values = np.ones(shape)
    if datatype != "BF16":
        return values.astype(DATATYPES[datatype])
    torch = tensors.installed_torch()
    if torch is None:
        raise UsageError("a BF16 input needs torch: pip install 'hybridflow-client[torch]', or pass --datatype FP32")
    return torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16)


def _cmd_infer(client: SingleControllerClient, args: argparse.Namespace) -> int:
    name, datatype, shape = _model_input(client, args)
    x = make_input(datatype, shape, args.random, args.seed)
    outputs = [args.output_name] if args.output_name else None
    binary = not args.json_data
    megabytes = tensors.to_wire(x).array.nbytes / 2**20
    print(f"# {args.model}: input {name!r} {datatype} {shape} ({megabytes:.1f} MiB)", file=sys.stderr)
    started = time.monotonic()
    result = wait_with_progress(
        f"infer {args.model}",
        lambda: client.infer_tensors(args.model, {name: x}, outputs, binary_inputs=binary, binary_outputs=binary),
        enabled=not args.no_progress,
    )
    print(f"# answered in {time.monotonic() - started:.3f} s", file=sys.stderr)
    for out_name, y in result.outputs.items():
        wire = tensors.to_wire(y, f"output {out_name!r}")
        values = wire.float64().reshape(-1)
        stats = ""
        if values.size:
            std = values.std(ddof=1) if values.size > 1 else 0.0
            stats = f" mean {values.mean():.6g} std {std:.6g} min {values.min():.6g} max {values.max():.6g}"
        print(f"{out_name}: {wire.datatype} {wire.shape}{stats}")
        print(f"  first values: {y.reshape(-1)[:8].tolist()}")
    return EXIT_OK


def _cmd_job(client: SingleControllerClient, args: argparse.Namespace) -> int:
    if not isinstance(args.args, list) or not isinstance(args.kwargs, dict):
        raise UsageError("--args must be a JSON list and --kwargs a JSON object")
    kwargs = dict(args.kwargs)
    if args.random_input:
        kwargs["x"] = [np.random.default_rng().random(args.random_input, dtype=np.float32)]
    submitted = client.submit_job(args.group, args.method, args.args, kwargs, binary=args.binary, split=args.split)
    print(f"# job {submitted['id']} submitted", file=sys.stderr)
    with ProgressLine(f"{args.group}.{args.method}", enabled=not args.no_progress) as line:
        final = client.wait_job(submitted["id"], on_progress=lambda job: line.bar(job["progress"], job["status"]))
    if final["status"] != "succeeded":
        print(f"error: job {final['id']} {final['status']}: {final.get('error') or ''}", file=sys.stderr)
        return EXIT_SERVICE
    print(f"# {args.group}.{args.method}: {final['elapsed_s']:.3f} s", file=sys.stderr)
    _print_output(client.job_result(final["id"], binary=args.binary), args.json)
    return EXIT_OK


def _cmd_events(client: SingleControllerClient, args: argparse.Namespace) -> int:
    if args.count is not None and args.count < 1:
        raise UsageError("--count must be at least 1")
    seen = 0
    try:
        for event in client.events(group=args.group, since=args.since):
            if args.json:
                print(json.dumps({"id": event.id, "event": event.kind, "data": event.data}), flush=True)
            else:
                when = time.strftime("%H:%M:%S", time.localtime(event.at)) if event.at else "--:--:--"
                fields = {k: v for k, v in event.data.items() if k not in ("group", "at")}
                details = " ".join(f"{k}={json.dumps(v)}" for k, v in fields.items())
                print(f"{when} {event.id or '-'} {event.kind} {event.group or '-'} {details}".rstrip(), flush=True)
            seen += 1
            if args.count is not None and seen >= args.count:
                break
    except KeyboardInterrupt:
        pass
    return EXIT_OK


COMMANDS: dict[str, Callable[[SingleControllerClient, argparse.Namespace], int]] = {
    "health": _cmd_health,
    "groups": _cmd_groups,
    "group": _cmd_group,
    "call": _cmd_call,
    "job": _cmd_job,
    "infer": _cmd_infer,
    "events": _cmd_events,
}


def main(argv: list[str] | None = None, transport: httpx.BaseTransport | None = None) -> int:
    """Run the CLI; returns the exit status (``transport``: an httpx transport for tests)."""
    args = build_parser().parse_args(argv)
    try:
        with SingleControllerClient(args.url, token=args.token, timeout=args.timeout, transport=transport) as client:
            return COMMANDS[args.command](client, args)
    except ServiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_SERVICE
    except httpx.TimeoutException as exc:
        print(f"error: no answer from {args.url} within {args.timeout:g} s ({type(exc).__name__})", file=sys.stderr)
        return EXIT_UNREACHABLE
    except httpx.TransportError as exc:
        print(f"error: cannot reach {args.url}: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except (UsageError, ValueError) as exc:  # ValueError: arguments the codec cannot encode
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
