"""Errors that name the field: a cross-field rule's error, the problems of a refused job, and how
pydantic's error locations become the user's field paths (e.g. `spec.training.microBatchSize`)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ValidationError


class FieldError(ValueError):
    """A cross-field error that belongs to a field other than where the validator runs."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


def field_error(path: str, message: str) -> FieldError:
    return FieldError(path, message)


class FieldProblem(BaseModel):
    """One problem with a job, located by its field path (e.g. `spec.training.microBatchSize`)."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class JobValidationError(ValueError):
    """A FineTuneJob that cannot be accepted; `problems` name each field."""

    def __init__(self, problems: list[FieldProblem]) -> None:
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


# Names pydantic inserts into an error location for the union member or validator it tried;
# the user's field path has none of them.
_UNION_TAG = re.compile(r"^(constrained-\w+|literal\[.*\]|int|str|float|bool|function-.*|lax-.*|json-or-python.*)$")


def _path_of(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif _UNION_TAG.match(str(item)):
            continue
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts)


def problems_from(error: ValidationError) -> list[FieldProblem]:
    problems: list[FieldProblem] = []
    seen: set[tuple[str, str]] = set()
    for item in error.errors(include_url=False):
        path = _path_of(item["loc"])
        message = item["msg"]
        ctx_error = (item.get("ctx") or {}).get("error")
        if isinstance(ctx_error, FieldError):
            # A cross-field rule raised from a parent: report the field it is about.
            path = ".".join(p for p in (path, ctx_error.path) if p)
            message = ctx_error.message
        elif message.startswith("Value error, "):
            message = message[len("Value error, ") :]
        if item["type"] == "extra_forbidden":
            message = "unknown field"
        elif item["type"] == "missing":
            message = "required field is missing"
        key = (path, message)
        if key not in seen:
            seen.add(key)
            problems.append(FieldProblem(path=path or "(root)", message=message))
    return problems


def merge_union_problems(problems: list[FieldProblem]) -> list[FieldProblem]:
    by_path: dict[str, list[FieldProblem]] = {}
    for problem in problems:
        by_path.setdefault(problem.path, []).append(problem)
    merged: list[FieldProblem] = []
    for path, group in by_path.items():
        union_msgs = [p.message for p in group if "'auto'" in p.message or "Input should be" in p.message]
        if len(group) > 1 and len(union_msgs) == len(group) and any("'auto'" in m for m in union_msgs):
            merged.append(FieldProblem(path=path, message="must be 'auto' or an integer: " + "; ".join(union_msgs)))
        else:
            merged.extend(group)
    return merged
