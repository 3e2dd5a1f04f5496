"""Where a job's files are and go: volumes, S3-compatible object storage and the Hugging Face Hub,
and the Secrets with their credentials (spec.model.source, spec.dataset.source, spec.output)."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from .schema import GIT_REVISION, MAX_TEXT, ApiModel, RelativePath, ShortName, Text, require_exactly_one, text_matching


class _ClaimPath(ApiModel):
    """A path inside a PersistentVolumeClaim in the job's namespace."""

    claim_name: ShortName
    """Name of the PersistentVolumeClaim."""
    path: RelativePath | None = None
    """Path inside the volume, relative to its root; the whole volume when omitted."""

    @field_validator("path")
    @classmethod
    def _no_parent(cls, value: str | None) -> str | None:
        if value is not None and ".." in value.split("/"):
            raise ValueError("must not contain '..' segments")
        return value


class PvcSource(_ClaimPath):
    """A path inside a PersistentVolumeClaim in the job's namespace, that the pods read."""

    read_only: bool = True
    """Mount the claim read-only (the default: the pods only read models and data); false mounts it read-write."""


class PvcTarget(_ClaimPath):
    """A path inside a PersistentVolumeClaim in the job's namespace, that the pods write: always mounted read-write."""


class SecretKeyRef(ApiModel):
    """A key of a Secret in the job's namespace."""

    name: ShortName
    """Name of the Secret."""
    key: Text = "token"
    """Key inside the Secret."""


class HuggingFaceSource(ApiModel):
    """A Hugging Face Hub repository, pinned to a revision. Downloaded by an init step in the pod."""

    repo: Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*$")]
    """Repository id, `owner/name`."""
    revision: text_matching(
        GIT_REVISION,
        "must be a commit hash, tag or branch: letters, digits and . _ - + /, starting with a letter,"
        " digit or '_' (a leading '-' would be read as an option of the download command)",
        200,
    )
    """Commit hash, tag or branch (letters, digits, `. _ - + /`; not starting with `-`). Required: an unpinned model is not reproducible."""
    token_secret_ref: SecretKeyRef | None = None
    """Secret holding the Hub token, for gated or private models."""


S3_ENDPOINT = r"^https?://[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?(:[0-9]{1,5})?/?$"
# S3 bucket names (the rules AWS and S3-compatible servers share): 3-63 lower-case letters,
# digits, '.' and '-', starting and ending with a letter or digit.
S3_BUCKET = r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$"
# An object key or prefix as a job may name it: relative (no leading '/'), no control characters
# (a key reaches logs, events and `kubectl describe` in messages).
S3_KEY = r"^([^/\x00-\x1f\x7f-\x9f][^\x00-\x1f\x7f-\x9f]*)?$"
UNSUPPORTED_URI_MESSAGE = (
    "uri sources and outputs are not supported yet (gs://, https://, and s3:// without an endpoint);"
    " for S3-compatible object storage use s3 (endpoint, bucket, key, credentialsSecretRef), or a pvc"
)


# What a key of a Secret's data may be.
SecretDataKey = Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")]


class S3CredentialsRef(ApiModel):
    """A Secret in the job's namespace holding the access key pair. Its values reach the pods only as
    environment variables of the containers that transfer (`secretKeyRef`), never in the trainer config."""

    name: ShortName
    """Name of the Secret."""
    access_key_id_key: SecretDataKey = "accessKeyId"
    """Key of the Secret that holds the access key id."""
    secret_access_key_key: SecretDataKey = "secretAccessKey"
    """Key of the Secret that holds the secret access key."""


class S3Location(ApiModel):
    """A bucket and key at an S3-compatible endpoint (path-style requests, SigV4). The endpoint
    must be one the cluster policy's `objectStorage` lists, in a region the job may use."""

    endpoint: Annotated[str, Field(min_length=1, max_length=255, pattern=S3_ENDPOINT)]
    """Endpoint URL, `https://host[:port]` (or `http://` where the policy lists it), e.g.
    `https://s3.eu-de-berlin.example`. Its region comes from the cluster policy, never from the job."""
    bucket: Annotated[str, Field(min_length=3, max_length=63, pattern=S3_BUCKET)]
    """Bucket name."""
    key: Annotated[str, Field(max_length=MAX_TEXT, json_schema_extra={"pattern": S3_KEY})] = ""
    """Object key, or a key prefix ending in `/` for a folder (everything under it); empty for the
    whole bucket. A model and an output are always folders (a `/` is added). Not starting with `/`;
    no control characters (line breaks, tabs, escapes)."""
    credentials_secret_ref: S3CredentialsRef
    """Secret with the access key pair."""
    signing_region: Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[a-z0-9][-a-z0-9]*$")] = "us-east-1"
    """Region name used to sign requests (SigV4); most S3-compatible servers accept any, often `us-east-1`."""

    @field_validator("key")
    @classmethod
    def _no_parent(cls, value: str) -> str:
        if not re.fullmatch(S3_KEY, value):
            raise ValueError("must not start with '/' or hold control characters (line breaks, tabs, escapes)")
        if any(part in ("..", ".") for part in value.split("/")):
            raise ValueError("must not contain '.' or '..' segments")
        return value

    @property
    def folder_key(self) -> str:
        """The key as a folder prefix (ends with `/`, or empty)."""
        return self.key if self.key == "" or self.key.endswith("/") else self.key + "/"


def _unsupported_uri(schemes: str) -> Any:
    """A `uri` field kept in the API so that the API server says why it is refused."""
    return WithJsonSchema(
        {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_TEXT,
            "x-kubernetes-validations": [{"rule": "false", "message": UNSUPPORTED_URI_MESSAGE}],
            "description": f"Not supported yet ({schemes}): refused by the API server. Use `s3` or `pvc`.",
        }
    )


UnsupportedUri = Annotated[str, Field(min_length=1, max_length=MAX_TEXT), _unsupported_uri("s3://, gs://, https://")]


def _reject_uri(value: str | None) -> str | None:
    if value is not None:
        raise ValueError(UNSUPPORTED_URI_MESSAGE)
    return value


class ModelSource(ApiModel):
    """Where the model weights come from. Set exactly one of `pvc`, `uri`, `hf`."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "[has(self.pvc), has(self.uri), has(self.hf), has(self.s3)].filter(x, x).size() == 1",
                    "message": "set exactly one of pvc, s3, hf",
                }
            ]
        }
    )

    pvc: PvcSource | None = None
    """Weights already on a volume (`HF_HUB_OFFLINE=1` is set in the pods)."""
    s3: S3Location | None = None
    """A folder (key prefix) in S3-compatible object storage, downloaded into the pods before training."""
    uri: UnsupportedUri | None = None
    """Not supported yet (`s3://`, `gs://`, `https://`): refused. Use `s3` or `pvc`."""
    hf: HuggingFaceSource | None = None
    """A Hugging Face Hub repository at a pinned revision."""

    @field_validator("uri")
    @classmethod
    def _uri_unsupported(cls, value: str | None) -> str | None:
        return _reject_uri(value)

    @model_validator(mode="after")
    def _exactly_one(self) -> "ModelSource":
        require_exactly_one(self, ("pvc", "s3", "hf"), also=("uri",))
        return self


class _VolumeOrUri(ApiModel):
    """A place that is either on a volume (`pvc`) or at a URI (`uri`), never both."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "[has(self.pvc), has(self.uri), has(self.s3)].filter(x, x).size() == 1",
                    "message": "set exactly one of pvc, s3",
                }
            ]
        }
    )

    @field_validator("uri", check_fields=False)
    @classmethod
    def _uri_unsupported(cls, value: str | None) -> str | None:
        return _reject_uri(value)

    @model_validator(mode="after")
    def _exactly_one(self) -> "_VolumeOrUri":
        require_exactly_one(self, ("pvc", "s3"), also=("uri",))
        return self


class DataSource(_VolumeOrUri):
    """Where the training data comes from. Set exactly one of `pvc`, `s3`."""

    pvc: PvcSource | None = None
    """A JSONL file (or a folder of them) on a volume."""
    s3: S3Location | None = None
    """A JSONL object, or a folder (key ending in `/`) of `*.jsonl` objects, in S3-compatible object
    storage; downloaded into the pods before training."""
    uri: UnsupportedUri | None = None
    """Not supported yet (`s3://`, `gs://`, `https://`): refused. Use `s3` or `pvc`."""


class OutputSpec(_VolumeOrUri):
    """Where the result (the adapter, or the full model) is written. Set exactly one of `pvc`, `s3`."""

    pvc: PvcTarget | None = None
    """A volume path for the result. Mounted read-write."""
    s3: S3Location | None = None
    """A folder (key prefix) in S3-compatible object storage: the master pod uploads the result there
    after training succeeds."""
    uri: UnsupportedUri | None = None
    """Not supported yet (`s3://`, `gs://`): refused. Use `s3` or `pvc`."""
