"""Errors WDE raises to users. Each carries enough context to fix the problem without a traceback."""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass
from typing import Iterable


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """A ' did you mean X?' suffix when a close match exists, else ''."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" did you mean {close[0]!r}?" if close else ""


@dataclass(frozen=True)
class Location:
    """Where a workflow key was written: a file (or '--set' for an override), 1-based line and column."""

    file: str
    line: int = 0
    column: int = 0

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}" if self.line else self.file


@dataclass(frozen=True)
class Issue:
    """One problem found in a workflow: where it is, the dotted key path, and what is wrong."""

    location: Location
    path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        return f"{self.location}: {where}{self.message}"

    def to_dict(self) -> dict:
        return {
            "file": self.location.file,
            "line": self.location.line,
            "column": self.location.column,
            "path": self.path,
            "message": self.message,
        }


class WorkflowError(ValueError):
    """A workflow file (or its overrides) is invalid; `issues` lists every problem found."""

    def __init__(self, issues: list[Issue]):
        self.issues = issues
        super().__init__("\n".join(str(i) for i in issues))


class RegistryError(ValueError):
    """A plugin registered something twice, or a name has no registration."""


class ModelLoadError(ValueError):
    """A model folder is missing, incomplete, or not something the chosen workflow can serve."""


SHOWN_CHARS = 120
"""The most characters of a value an error message echoes (see `shown`)."""


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """`repr(value)` as an error message echoes what it refuses: whole when short, else its first `limit`
    characters, an ellipsis and the length of the whole, so a 10 MB string given by mistake makes a short message
    (it used to be echoed whole: 10 MB on a terminal, in a log line, in a JSON error)."""
    if isinstance(value, str):
        return repr(value) if len(value) <= limit else f"{value[:limit]!r}… ({len(value):,} characters)"
    return brief(repr(value), limit)


def brief(text: object, limit: int = SHOWN_CHARS) -> str:
    """`str(text)` as an error message shows a key or a command-line value: whole when short, else its first
    `limit` characters, an ellipsis and its length (`shown` is the same for a quoted value)."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters)"


def one_line(text: object) -> str:
    """`text` on one line (whitespace runs, newlines included, become one space): a start-up error is one line."""
    return " ".join(str(text).split())


class RequestError(ValueError):
    """A request was rejected: the message names the field and the limit.

    `kind` says whose fault and how the server answers: "validation" (422), "empty" (400), "encoding" (400: the
    text is not valid Unicode), "too_long" (422), "bad_image" (not an image, truncated, unsupported mode, a URL:
    docs/images.md), "image_too_large" (over the image byte or pixel limit), or "internal" (500: ours, not the
    input's; the message then carries no internals, only the request id, and the log has the traceback).
    """

    def __init__(self, message: str, field: str | None = None, kind: str = "validation"):
        self.field = field
        self.kind = kind
        super().__init__(message)


def internal_error(request_id: str, error: BaseException, where: str) -> RequestError:
    """The error a request gets when our code failed on it: logged here with its traceback, while the message
    the caller sees names only the request, never the internals."""
    logging.getLogger("wde").error("request %s failed in %s: %s: %s", request_id, where, type(error).__name__, error,
                                   exc_info=error)
    failure = RequestError(f"internal error while serving request {request_id} ({where}); the server log has the"
                           " details", kind="internal")
    failure.__cause__ = error
    return failure
