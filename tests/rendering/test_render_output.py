"""The CLI's YAML reads back as exactly what was rendered, whatever the strings hold."""

from __future__ import annotations

import pytest
import yaml

from finetune_operator.rendering.output import manifests_yaml

TRICKY = [
    "\x85", "a\x85b", "\u2028", "\u2029", "\ufeff", "\x00", "\t", " lead", "trail ", "a\n", "\n",
    "a\nb\n", "a \nb", "x\n  y: 1", "- a\n- b", "{{ x }}\n{% y %}", "&a\n*a", "é\n🚀", "'\"\\", "null", "~", "",
]


@pytest.mark.parametrize("text", TRICKY, ids=repr)
def test_round_trip(text):
    objects = [{"data": {"config.json": text, "plain": text}}, {"list": [text, {"k": text}]}]
    assert list(yaml.safe_load_all(manifests_yaml(objects))) == objects


def test_multi_line_config_is_a_literal_block():
    text = manifests_yaml([{"data": {"config.json": '{\n  "a": 1\n}'}}])
    assert "config.json: |-\n    {\n      \"a\": 1\n    }\n" in text
