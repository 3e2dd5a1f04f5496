"""Credential-shaped strings out of text the operator quotes back to people.

A crashing process prints whatever it had at hand: an `Authorization` header of a failed
HTTP call, a presigned URL of the dataset, an environment dump with a token. The
container's termination message carries the tail of that log, and the operator quotes it
into the FineTuneJob's conditions, its attempt history and Events, which anyone who may
read the FineTuneJob can read: far more people than those who may read the Secret the
token came from. So every message recovery produces passes through `redact` first.

Redaction is by shape, not by knowing the secret: it removes what looks like a credential
(a bearer token, an access key id, a JWT, a private key block, the value of a `password=`
or `token:`, the signature of a presigned URL, the password in `scheme://user:pass@host`)
and keeps the rest, so the message still says what went wrong. A false positive costs a
few characters of a log line; a false negative leaks a credential, so the patterns lean
towards removing. `bounded` caps the length too: a condition is a sentence, not a log.
"""

from __future__ import annotations

import re

REDACTED = "[REDACTED]"
# Longest message recovery quotes. Events are cut at 1 KiB by the API server and the
# lifecycle adds its own words around the message; a condition stays readable in
# `kubectl describe`.
MESSAGE_LIMIT = 600
_ELLIPSIS = "…"

# Key names whose value is a secret, as they appear in env dumps, config prints, query
# strings and JSON (`HF_TOKEN=...`, `"password": "..."`, `aws_secret_access_key = ...`,
# `client-secret: ...`). The name must END with one of these words (whatever comes before
# it), so `tokenizer: x` and `max_tokens=4096` are left alone. The pattern matches from the
# word on: a prefix pattern (`[\w.-]*token`) would be tried from every word boundary to
# the end of a long run of such characters, quadratic in the message's length.
_SECRET_KEY_WORDS = (
    r"token",
    r"passw(?:or)?d",
    r"pwd",
    r"secret",
    r"api[_-]?key",
    r"apikey",
    r"access[_-]?key(?:[_-]?id)?",
    r"secret[_-]?key",
    r"private[_-]?key",
    r"account[_-]?key",
    r"credentials?",
    r"auth",
    r"signature",
    r"session[_-]?id",
    r"cookie",
)
_KEY = r"(?:" + "|".join(_SECRET_KEY_WORDS) + r")"

# Query-string parameters of presigned / signed URLs (S3 SigV4 and V2, GCS, Azure SAS) and
# common token parameters. Only the value goes; the URL's host and path stay.
_QUERY_PARAMS = (
    "X-Amz-Signature",
    "X-Amz-Credential",
    "X-Amz-Security-Token",
    "X-Goog-Signature",
    "X-Goog-Credential",
    "Signature",
    "AWSAccessKeyId",
    "sig",
    "access_token",
    "id_token",
    "refresh_token",
    "token",
    "api_key",
    "apikey",
    "key",
    "code",
    "password",
    "secret",
)

# (pattern, replacement), applied in order. Block and structured shapes come first, so a
# later, more general pattern does not cut them in half.
_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    # PEM private keys, whole blocks; a block the tail cut before its END line goes to the end.
    (
        re.compile(
            r"-----BEGIN[A-Z0-9 ]*PRIVATE KEY-----.*?(?:-----END[A-Z0-9 ]*PRIVATE KEY-----|\Z)",
            re.DOTALL,
        ),
        REDACTED,
    ),
    # Authorization headers, whatever the scheme: `Authorization: Bearer x`, `authorization=Basic x`.
    (
        re.compile(
            r"""(?i)(\b(?:proxy-)?authorization["']?\s*[:=]\s*["']?)(?:(?:bearer|basic|token|digest|aws4-hmac-sha256)\s+)?[^\s"',;]+(?:[^\n"']*)?"""
        ),
        r"\1" + REDACTED,
    ),
    # Bearer tokens anywhere else (`curl -H "Bearer x"`, exception texts).
    (re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9\-._~+/]+=*"), r"\1" + REDACTED),
    # JSON Web Tokens: three base64url parts, the first a JSON header ('{"' encodes as eyJ).
    (re.compile(r"\beyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*"), REDACTED),
    # Hugging Face, GitHub, Slack, OpenAI-style tokens by their prefixes.
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}"), REDACTED),
    (re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})"), REDACTED),
    (re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}"), REDACTED),
    (re.compile(r"\bsk-[A-Za-z0-9_-]{20,}"), REDACTED),
    # AWS access key ids (long-term AKIA, temporary ASIA, and the other documented prefixes).
    (re.compile(r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA|ABIA|ACCA)[A-Z0-9]{16}\b"), REDACTED),
    # The password of a URL's userinfo: scheme://user:password@host.
    (re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]{0,30}://[^\s:/@]{1,256}:)[^\s@/]{1,512}(@)"), r"\1" + REDACTED + r"\2"),
    # Signed-URL and token query parameters.
    (
        re.compile(r"(?i)([?&](?:" + "|".join(re.escape(p) for p in _QUERY_PARAMS) + r")=)[^&\s\"'#<>]+"),
        r"\1" + REDACTED,
    ),
    # key = value / key: value / "key": "value" with a secret-shaped key name (a value that
    # an earlier rule already replaced is left as it is, so redact() is idempotent).
    (
        re.compile(
            r"""(?i)(""" + _KEY + r"""["']?\s*[:=]\s*)(?!["']?\[REDACTED\])("[^"\n]*"|'[^'\n]*'|[^\s"',;&)}\]]+)"""
        ),
        r"\1" + REDACTED,
    ),
)


def redact(text: str) -> str:
    """`text` with every credential-shaped part replaced by [REDACTED]. Idempotent."""
    if not text:
        return text
    for pattern, replacement in _RULES:
        text = pattern.sub(replacement, text)
    return text


def bounded(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """`text` redacted and cut to at most `limit` characters (an ellipsis marks a cut)."""
    if limit < 1:
        raise ValueError(f"limit: must be at least 1, got {limit}")
    text = redact(text)
    if len(text) <= limit:
        return text
    cut = max(limit - len(_ELLIPSIS), 0)
    # Never half a marker: "token=[REDA…" would read as a value and be redacted again.
    marker = text.rfind(REDACTED, 0, cut + len(REDACTED))
    if marker != -1 and marker < cut < marker + len(REDACTED):
        cut = marker
    return text[:cut].rstrip() + _ELLIPSIS
