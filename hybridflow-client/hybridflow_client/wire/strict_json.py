"""The one strict JSON loader for bytes from the network, and the compact dumper.

Strict: UTF-8 only (as RFC 8259 requires of JSON between systems), no NaN or Infinity, no
number that overflows a 64-bit float or integer (a client reading its service's answers
may take wider integers, ``wide_ints``), and at most ``limits.max_json_values`` values,
counted on the bytes before anything is built. Every refusal is a :class:`WireError` with
``unparsed`` set: the bytes are no document a body may hold.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.limits import DEFAULT_LIMITS, WireLimits

__all__ = ["JsonBudget", "dumps_compact", "loads_strict", "parse_counted", "value_bound"]

#: A JSON string, escapes included (possessive, so a long body is scanned once).
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"')
#: Digits of the longest int64 (and its sign).
_INT64_CHARS = 20


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range for a 64-bit float")
    return value


def _int64(text: str) -> int:
    # The length test comes first: int() of thousands of digits is slow, then refused.
    if len(text) <= _INT64_CHARS:
        value = int(text)
        if -(1 << 63) <= value < (1 << 63):
            return value
    raise ValueError(f"integer {text[:40]}{'...' if len(text) > 40 else ''} is out of the 64-bit range")


def _quick_bound(raw: bytes) -> int:
    """An upper bound on the values, strings and all: one, plus one per ``,``, ``[`` and ``{``."""
    return 1 + raw.count(b",") + raw.count(b"[") + raw.count(b"{")


def value_bound(raw: bytes) -> int:
    """At most how many JSON values ``raw`` holds (every number, string, literal, list and
    object counts one), counted at C speed without parsing or building anything. Outside
    strings, a list's items are its commas plus one unless it is empty, an object's members
    likewise, and each member has one value: so the values are one (the outermost) plus
    the commas plus the non-empty lists and objects. Exact for JSON without white space
    inside empty lists and objects (such white space only adds to the count)."""
    outside = _STRING.sub(b"", raw) if b'"' in raw else raw
    empty = outside.count(b"[]") + outside.count(b"{}")
    return _quick_bound(outside) - empty


class JsonBudget:
    """The JSON values one body may still hold: every document parsed from the body spends
    from the same ``limits.max_json_values``."""

    def __init__(self, limits: WireLimits = DEFAULT_LIMITS) -> None:
        self.limit = limits.max_json_values
        self.spent = 0

    def spend(self, raw: bytes | bytearray | memoryview | str, what: str = "body", exact: bool = True) -> bytes:
        """``raw`` as bytes, once its values are counted against what is left; a
        :class:`WireError` (nothing spent) when it is not UTF-8 or holds more than is left.
        ``exact=False`` (for a budget spent once) may spend an over-count: it skips
        stripping strings when even counting inside them leaves the document within."""
        data = raw.encode() if isinstance(raw, str) else bytes(raw)
        # UTF-8 JSON never holds a NUL byte; UTF-16/32 always does, and its bytes would fool the count.
        if b"\0" in data:
            raise WireError(
                f"{what} is not valid JSON: it must be UTF-8 (a NUL byte at offset {data.index(0)})", unparsed=True
            )
        left = self.limit - self.spent
        # The quick bound counts inside strings too and is cheaper: strip strings only when it is
        # over, or when what is left matters to documents after this one.
        count = _quick_bound(data)
        if count > left or (exact and b'"' in data):
            count = value_bound(data)
        if count > left:
            if self.spent:
                raise WireError(
                    f"{what} takes the body past {self.limit} JSON values (limits.max_json_values counts "
                    f"every document of a body; {self.spent} came before it); "
                    "send large tensors as safetensors or OIP binary data", unparsed=True
                )
            raise WireError(
                f"{what} holds more than {self.limit} JSON values (limits.max_json_values); "
                "send large tensors as safetensors or OIP binary data", unparsed=True
            )
        self.spent += count
        return data


def parse_counted(data: bytes, what: str = "body", wide_ints: bool = False) -> Any:
    """Parsed JSON of bytes a :class:`JsonBudget` has counted, with the strict rules."""
    try:
        return json.loads(data, parse_constant=_reject_constant, parse_float=_finite_float,
                          parse_int=int if wide_ints else _int64)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise WireError(f"{what} is not valid JSON: {exc}", unparsed=True) from None


def loads_strict(
    raw: bytes | bytearray | memoryview | str,
    what: str = "body",
    limits: WireLimits = DEFAULT_LIMITS,
    budget: JsonBudget | None = None,
    wide_ints: bool = False,
) -> Any:
    """Parsed JSON, or a :class:`WireError` saying ``what`` is not valid JSON or holds more
    than ``limits.max_json_values`` values (or more than ``budget`` has left, when given).
    ``wide_ints`` takes integers past 64 bits (what a Python answer may hold)."""
    if budget is None:
        return parse_counted(JsonBudget(limits).spend(raw, what, exact=False), what, wide_ints)
    return parse_counted(budget.spend(raw, what), what, wide_ints)


def dumps_compact(value: Any) -> bytes:
    """Compact UTF-8 JSON; a NaN or infinity is an error (the encoders spell them as strings)."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()
