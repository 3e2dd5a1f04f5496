"""The API server's rules for label keys and values, checked before anything is rendered.

Pool selectors, taints, the profile pod's node selector and tolerations and the policy's region
label come from the platform's catalog and policy, not from the API server; a bad one would make
every attempt fail at creation, far from its cause, so the renderer (or the policy's loader) names
it instead.
"""

from __future__ import annotations

import re

_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def is_qualified_name(key: str) -> bool:
    """A label key / taint key: `[prefix/]name`, prefix a DNS subdomain (<= 253), name <= 63."""
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(prefix)):
        return False
    return 0 < len(name) <= 63 and bool(_NAME.fullmatch(name))


def is_label_value(value: str) -> bool:
    return len(value) <= 63 and bool(_LABEL_VALUE.fullmatch(value))
