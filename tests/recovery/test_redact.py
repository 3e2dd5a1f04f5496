"""Redaction of credential-shaped strings in what recovery quotes (conditions, Events)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from finetune_operator.recovery.redact import MESSAGE_LIMIT, REDACTED, bounded, redact

# (text, the secret that must go, what must stay)
CASES = [
    ("Authorization: Bearer abc.DEF-123_xyz", "abc.DEF-123_xyz", "Authorization:"),
    ("proxy-authorization=Basic dXNlcjpwYXNz", "dXNlcjpwYXNz", "proxy-authorization="),
    ("{'Authorization': 'token ghs_1234', 'Host': 'hub.example'}", "ghs_1234", "'Host': 'hub.example'"),
    ('curl -H "Bearer eyQ9x1_2/3+4=="', "eyQ9x1_2/3+4", "curl -H"),
    ("key id AKIAIOSFODNN7EXAMPLE was denied", "AKIAIOSFODNN7EXAMPLE", "was denied"),
    ("temporary ASIAY34FZKBOKMUTVV7A expired", "ASIAY34FZKBOKMUTVV7A", "expired"),
    ("aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "wJalrXUtnFEMI", "aws_secret_access_key"),
    ("AWS_SESSION_TOKEN=FwoGZXIvYXdzEBYaD", "FwoGZXIvYXdzEBYaD", "AWS_SESSION_TOKEN="),
    ("GET https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=cred%2F2026&X-Amz-Signature=f00d",
     "f00d", "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256"),
    ("GET https://b.s3.amazonaws.com/k?X-Amz-Credential=cred%2F2026%2Feu&X-Amz-Date=1", "cred%2F2026", "X-Amz-Date=1"),
    ("https://s3.amazonaws.com/b/k?AWSAccessKeyId=ID&Expires=1&Signature=vjbyPxybdZaNmGa%2ByT272YEAiv4%3D",
     "vjbyPxybdZaNmGa", "Expires=1"),
    ("https://storage.googleapis.com/b/o?X-Goog-Signature=0a1b2c&X-Goog-Date=2026", "0a1b2c", "X-Goog-Date=2026"),
    ("https://acct.blob.core.windows.net/c/b?sv=2022-11-02&sig=Zm9vYmFy%3D", "Zm9vYmFy", "sv=2022-11-02"),
    ("token=abc123 retrying", "abc123", "retrying"),
    ("password: hunter2!", "hunter2!", "password:"),
    ('{"password": "p@ss w0rd", "user": "bob"}', "p@ss w0rd", '"user": "bob"'),
    ("DB_PASSWD='x y z'", "x y z", "DB_PASSWD="),
    ("client_secret=s3cr3t&grant_type=client_credentials", "s3cr3t", "grant_type=client_credentials"),
    ("WANDB_API_KEY=0123456789abcdef", "0123456789abcdef", "WANDB_API_KEY="),
    ("login with hf_AbCdEfGhIjKlMnOpQrStUvWxYz01 failed", "hf_AbCdEfGhIjKlMnOpQrStUvWxYz01", "failed"),
    ("ghp_0123456789abcdefghijABCDEFGHIJ0123", "ghp_0123456789abcdefghij", ""),
    ("session eyJhbGciOiJSUzI1NiIsImtpZCI6IjEifQ.eyJzdWIiOiJzeXN0ZW06c2EifQ.c2lnbmF0dXJl ok",
     "eyJzdWIiOiJzeXN0ZW06c2EifQ", "ok"),
    ("postgres://trainer:Sup3rS3cret@db.internal:5432/runs", "Sup3rS3cret", "postgres://trainer:"),
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA\nZm9vYmFy\n-----END RSA PRIVATE KEY-----\nnext line",
     "MIIEowIBAAKCAQEA", "next line"),
    ("-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0B", "MIIEvQIBADANBgkqhkiG9w0B", ""),
]


@pytest.mark.parametrize("text,secret,kept", CASES, ids=[c[1][:16] for c in CASES])
def test_a_credential_is_removed_and_the_rest_kept(text, secret, kept):
    out = redact(text)
    assert secret not in out, out
    assert REDACTED in out
    assert kept in out, out


@pytest.mark.parametrize("text", [
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB",
    "KeyError: 'input_ids'",
    "tokenizer: /models/llama max_tokens=4096 num_tokens 512",
    "author: Ada; keyword: x",
    "see https://pytorch.org/docs/stable/notes/cuda.html#environment-variables",
    "failed (exitcode: -9) local_rank: 1 (pid: 59) of binary: /usr/bin/python",
    "line 17: not JSON",
])
def test_ordinary_log_lines_are_left_alone(text):
    assert redact(text) == text


_PIECES = st.lists(st.sampled_from([c[0] for c in CASES]) | st.text(max_size=40), max_size=6).map("\n".join)


@settings(max_examples=200, deadline=None)
@given(_PIECES)
def test_redaction_is_idempotent_and_bounded(text):
    once = redact(text)
    assert redact(once) == once
    out = bounded(text)
    assert len(out) <= MESSAGE_LIMIT
    assert bounded(out) == out


def test_a_cut_never_leaves_half_a_marker():
    # "token=[REDA…" would read as a value to the next reader (and to redact() again).
    text = "token=abc123 " * 40
    for limit in range(1, 300):
        out = bounded(text, limit)
        assert len(out) <= limit
        body = out.removesuffix("…")
        assert body.count("[") == body.count(REDACTED), (limit, out)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(CASES), st.text(max_size=30), st.text(max_size=30))
def test_a_credential_goes_whatever_surrounds_it(case, before, after):
    text, secret, _ = case
    # Separated by lines, as in a log: words glued to a secret may legitimately change its shape.
    assert secret not in redact(f"{before}\n{text}\n{after}")


def test_bounded_cuts_with_a_mark():
    out = bounded("a" * 2000, limit=100)
    assert len(out) == 100 and out.endswith("…")
    with pytest.raises(ValueError):
        bounded("x", limit=0)


@pytest.mark.parametrize("text", [
    "a." * 6000, "a-" * 6000, "a://" * 8000, "password: " * 3000, ("ab://cd:" + "e" * 100) * 300,
    "-----BEGIN PRIVATE KEY-----" + "a" * 32000, "Authorization: " + "x" * 32000,
], ids=["dots", "dashes", "schemes", "keys", "userinfo", "pem", "header"])
def test_redaction_is_linear_on_hostile_text(text):
    # A pattern that backtracks from every word boundary made 32 KB of "a.a.a." take minutes:
    # a crashing process controls this text, and the operator's loop would stall on it.
    import time

    started = time.perf_counter()
    redact(text)
    assert time.perf_counter() - started < 2.0
