"""Attempt names and label values: deterministic, valid, and distinct for distinct jobs."""

from __future__ import annotations

import pytest

from finetune_operator.k8s_names import is_label_value, is_qualified_name
from finetune_operator.rendering.names import DNS1035_LABEL, MAX_OBJECT_NAME, attempt_name, label_value


def test_a_short_name_is_kept():
    assert attempt_name("support-bot", 1) == "support-bot-a1"
    assert attempt_name("support-bot", 12) == "support-bot-a12"


@pytest.mark.parametrize("job", ["a.b", "9lives", "x" * 253, "a" * 49, "a." * 100 + "b", "0", "a-" * 40 + "b"])
@pytest.mark.parametrize("attempt", [1, 7, 20])
def test_every_name_is_a_dns1035_label_with_room_for_the_replica_suffix(job, attempt):
    name = attempt_name(job, attempt)
    assert DNS1035_LABEL.fullmatch(name), name
    assert len(name) <= MAX_OBJECT_NAME
    assert len(f"{name}-worker-4095") <= 63
    assert name.endswith(f"-a{attempt}")
    assert attempt_name(job, attempt) == name  # stable


def test_names_that_would_collide_get_distinct_hashes():
    assert attempt_name("a.b", 1) != attempt_name("a-b", 1)
    long_a, long_b = "x" * 100 + "a", "x" * 100 + "b"
    assert attempt_name(long_a, 1) != attempt_name(long_b, 1)
    assert attempt_name(long_a, 1) != attempt_name(long_a, 2)


def test_attempt_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        attempt_name("job", 0)


@pytest.mark.parametrize("text", ["ok", "a.b_c-d", "x" * 63, "x" * 64, "a" * 253, "-lead", "trail.", "é"])
def test_label_values(text):
    value = label_value(text)
    assert is_label_value(value)
    if is_label_value(text):
        assert value == text
    else:
        assert value != label_value(text + "x")


def test_qualified_names():
    assert is_qualified_name("topology.kubernetes.io/region")
    assert is_qualified_name("region")
    assert not is_qualified_name("/region")
    assert not is_qualified_name("Bad_Prefix/region")
    assert not is_qualified_name("a/" + "x" * 64)
    assert not is_qualified_name("a/b/c")
    assert not is_qualified_name("")
