"""Deterministic names and label values for what an attempt creates.

Every object of attempt N of job J is named `J-aN`. The name must be a DNS-1035 label
(the training operator's webhook checks it, and it becomes the prefix of Service names),
so it starts with a letter, holds only `[a-z0-9-]` and ends with a letter or digit. The
training operator derives pod and Service names `<name>-worker-<i>` from it, which must
stay within 63 characters too, so the PyTorchJob name leaves room for that suffix.

A job name that does not fit as-is (too long, a dot, a leading digit) is shortened and
given an 8-hex-digit hash of the full job name, so two jobs never share a name and the
same job always gets the same one.
"""

from __future__ import annotations

import hashlib
import re

DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
MAX_LABEL = 63
# "-worker-" plus the largest replica index the plan can ask for (api.MAX_GPUS nodes).
REPLICA_SUFFIX_ROOM = len("-worker-4095")
MAX_OBJECT_NAME = MAX_LABEL - REPLICA_SUFFIX_ROOM
HASH_LENGTH = 8


def short_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:HASH_LENGTH]


def attempt_name(job_name: str, attempt: int) -> str:
    """`<job>-a<N>`: the name of attempt N's PyTorchJob and ConfigMap (a DNS-1035 label)."""
    if attempt < 1:
        raise ValueError(f"attempt must be at least 1, got {attempt}")
    suffix = f"-a{attempt}"
    plain = f"{job_name}{suffix}"
    if len(plain) <= MAX_OBJECT_NAME and DNS1035_LABEL.fullmatch(plain):
        return plain
    # Keep what the name says (lower-case, dots as dashes), then the hash of the real name.
    base = re.sub(r"[^a-z0-9-]", "-", job_name.lower())
    tail = f"-{short_hash(job_name)}{suffix}"
    room = MAX_OBJECT_NAME - len(tail)
    base = base.lstrip("-")
    if not base or not base[0].isalpha():
        base = "j" + base  # DNS-1035 labels start with a letter
    return base[:room].rstrip("-") + tail


def label_value(text: str) -> str:
    """`text` as a label value: itself when valid, else a valid prefix plus a hash of the whole."""
    if len(text) <= MAX_LABEL and LABEL_VALUE.fullmatch(text):
        return text
    tail = f"-{short_hash(text)}"
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "-", text)[: MAX_LABEL - len(tail)]
    cleaned = re.sub(r"^[^A-Za-z0-9]+", "", cleaned)
    cleaned = re.sub(r"[^A-Za-z0-9]+$", "", cleaned)
    return f"{cleaned}{tail}" if cleaned else short_hash(text)
