"""jinja2 that can only print data.

Templates hold the fixed shape of each manifest as JSON text. Every value reaches them as
data and is printed through the `json` filter, which encodes it as one closed JSON value;
the result is parsed right away. A value therefore cannot add a key, close a string, start
a list or change an affinity, whatever characters it holds. Two guards make that a rule
rather than a habit: the environment's `finalize` refuses to print anything that did not
come out of the `json` filter (a bare `{{ name }}` fails the render), and the parser
refuses duplicate keys.
"""

from __future__ import annotations

import json
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined, TemplateError


class _JsonText(str):
    """Text the `json` filter produced: the only thing a template may print."""


def _json_filter(value: Any) -> _JsonText:
    # ASCII escapes keep lone surrogates and line separators out of the intermediate text;
    # allow_nan=False because NaN is not JSON and the API server would refuse it.
    return _JsonText(json.dumps(value, ensure_ascii=True, allow_nan=False))


def _finalize(value: Any) -> Any:
    if isinstance(value, _JsonText):
        return value
    raise TemplateError(
        f"a template printed {type(value).__name__} {str(value)[:80]!r} without the json filter;"
        " every printed value must be `{{ value | json }}`"
    )


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise TemplateError(f"a template produced the key {key!r} twice in one object")
        result[key] = value
    return result


_ENV = Environment(
    loader=PackageLoader("finetune_operator.rendering", "templates"),
    undefined=StrictUndefined,
    autoescape=False,
    finalize=_finalize,
    keep_trailing_newline=True,
)
_ENV.filters["json"] = _json_filter


def render_json_template(name: str, **data: Any) -> dict[str, Any]:
    """Render template `name` with `data` and parse the JSON it produces."""
    text = _ENV.get_template(name).render(**data)
    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as error:
        # Only a broken template can get here (values are always encoded); say where.
        lines = text.splitlines()
        near = lines[error.lineno - 1] if 0 < error.lineno <= len(lines) else ""
        raise TemplateError(f"template {name} produced invalid JSON at line {error.lineno}: {error.msg}: {near!r}") from None
