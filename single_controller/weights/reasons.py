"""What a weight sync's error message may say of an exception: one line, its type and
message, with no traceback, terminal colour codes, file paths, process ids, actor ids or
addresses. A message goes to clients and into a group's status; the full exception goes
to the log.

Ray's ``RayTaskError`` text is a remote traceback headed by the worker's process id, node
address and actor id in colour codes, with the source paths of every frame: its reason is
its cause's (the exception the worker raised). A lost worker (``RayActorError`` and
Ray's other errors) is named by its type alone: its text names the process and node.
"""

from __future__ import annotations

import re

from ray.exceptions import RayActorError, RayError, RayTaskError

#: Terminal control sequences (colour codes): ESC [ ... letter.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
#: Ray's "(pid=123, ip=10.0.0.1, actor_id=..., repr=...)" and any one of its fields.
_RAY_PLACE = re.compile(r"\((?:pid|ip|actor_id|repr)=[^)]*\)")
_RAY_FIELD = re.compile(r"\b(?:pid|ip|actor_id|node_id|worker_id|job_id)=[^\s,;)]+,?\s*")
#: An absolute path (POSIX or Windows drive) after a start, space, quote or bracket.
_PATH = re.compile(r"""(?<![\w.:/])(?:/|[A-Za-z]:\\)[^\s'"(),;]+""")
#: IPv4 and bracketless IPv6 addresses, with a port when given.
_IPV4 = re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b")
_H = "[0-9A-Fa-f]{1,4}"
_IPV6 = re.compile(rf"(?<![\w:])(?:{_H}(?::{_H}){{7}}|(?:{_H}(?::{_H})*)?::(?:{_H}(?::{_H})*)?)(?![\w:])")
#: A message's length in a status or an answer.
MAX_CHARS = 400


def _last_component(match: re.Match[str]) -> str:
    path = match.group(0).rstrip("/\\")
    name = re.split(r"[/\\]", path)[-1]
    return name or "<path>"


def scrub(text: str) -> str:
    """``text`` as one line a client may read: its last non-empty line (a traceback ends
    with the error), colour codes, Ray's process and node fields and addresses removed,
    absolute paths cut to their last component, at most ``MAX_CHARS`` characters."""
    text = _ANSI.sub("", text)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[-1] if lines else ""
    line = _RAY_PLACE.sub("", line)
    line = _RAY_FIELD.sub("", line)
    line = _PATH.sub(_last_component, line)
    line = _IPV4.sub("<address>", line)
    line = _IPV6.sub("<address>", line)
    line = re.sub(r"\s+", " ", line).strip()
    return line if len(line) <= MAX_CHARS else line[: MAX_CHARS - 3] + "..."


def reason_of(exc: BaseException) -> str:
    """One line for ``exc`` (see the module docstring): ``Type: message``, or the type
    alone for a lost worker or an error without a message."""
    if isinstance(exc, RayTaskError) and not isinstance(exc, RayActorError):
        cause = getattr(exc, "cause", None)
        if cause is not None and cause is not exc:
            return reason_of(cause)
        name = exc.__class__.__name__
        return name.removeprefix("RayTaskError(").removesuffix(")") if name.startswith("RayTaskError(") else name
    if isinstance(exc, RayError):
        return type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:  # its text names the file
        return f"{type(exc).__name__}: {exc.strerror}"
    message = scrub(str(exc))
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__
