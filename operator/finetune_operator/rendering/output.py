"""Rendered objects as YAML a person can read and `kubectl apply -f -` accepts."""

from __future__ import annotations

import re
from typing import Any

import yaml


class _ManifestDumper(yaml.SafeDumper):
    """Multi-line strings (the trainer's config.json) as literal blocks instead of escaped one-liners."""


# Characters YAML readers take as line breaks (or drop) but PyYAML's emitter writes raw when
# allow_unicode is on: a string holding one is written double-quoted, where they are escaped.
_RAW_UNSAFE = re.compile("[\x85\u2028\u2029\ufeff]")


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    if _RAW_UNSAFE.search(value):
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style='"')
    if "\n" in value:
        # PyYAML falls back to a quoted scalar by itself when a block cannot hold the text exactly.
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", value)


_ManifestDumper.add_representer(str, _represent_str)


def manifests_yaml(objects: list[dict[str, Any]]) -> str:
    """A multi-document YAML stream, keys in the order rendered."""
    return yaml.dump_all(objects, Dumper=_ManifestDumper, sort_keys=False, allow_unicode=True, explicit_start=True)
