"""The API's names and the building blocks of its schema: the base model, bounds and patterns,
`auto`-or-integer fields and checked text, each said once for pydantic and for the CRD."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel


GROUP = "finetune.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "FineTuneJob"
PLURAL = "finetunejobs"
SINGULAR = "finetunejob"
SHORT_NAMES = ["ftj"]

DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# Label values: what `kueue.x-k8s.io/queue-name` and region label values must satisfy.
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"

# Bounds that keep CEL rules within the API server's cost budget and catch typos
# such as a sequence length of 4_000_000. They are generous on purpose.
MAX_SEQUENCE_LENGTH = 1_048_576
MAX_GLOBAL_BATCH = 1_048_576
MAX_GPUS = 4096
MAX_NAME = 253
MAX_TEXT = 1024


class ApiModel(BaseModel):
    """Base of every spec model: camelCase in YAML, unknown fields are errors."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
        # Strict, like the API server: "yes" is not a boolean and "4" is not an integer.
        strict=True,
    )


ACCEPTS_KEY = "x-finetune-accepts"


def auto_or_int(minimum: int, maximum: int, what: str) -> Any:
    """`auto` or an integer in [minimum, maximum] (`what` names the integer in the message), spelled
    the way Kubernetes can check it. Also the type of a lever's spec field declared `AutoOrInt`
    (api/training.py)."""
    return Annotated[
        Union[Literal["auto"], Annotated[int, Field(ge=minimum, le=maximum)]],
        WithJsonSchema(
            {
                "x-kubernetes-int-or-string": True,
                "anyOf": [{"type": "integer"}, {"type": "string"}],
                # What the field accepts, added to its description by crd.py: `kubectl explain` can only
                # call an int-or-string field <Object>.
                ACCEPTS_KEY: f"`auto` or an integer from {minimum} to {maximum}",
                "x-kubernetes-validations": [
                    {
                        "rule": (
                            f"type(self) == int ? (self >= {minimum} && self <= {maximum})"
                            " : self == 'auto'"
                        ),
                        "message": f"must be 'auto' or an integer {what} between {minimum} and {maximum}",
                    }
                ],
            }
        ),
    ]


AutoOrPositiveInt = auto_or_int(1, MAX_GPUS, "count")
AutoOrMicroBatch = auto_or_int(1, 4096, "micro-batch size")


def text_matching(pattern: str, message: str, max_length: int) -> Any:
    """A string the CRD checks with `pattern` (Go RE2 at the API server) and pydantic with the
    same pattern and a message a person reads (`fullmatch`: no trailing newline slips through)."""
    compiled = re.compile(pattern)

    def check(value: str) -> str:
        if not compiled.fullmatch(value):
            raise ValueError(message)
        return value

    return Annotated[
        str, Field(min_length=1, max_length=max_length, json_schema_extra={"pattern": pattern}), AfterValidator(check)
    ]


# One line of printable text: no C0/C1 control characters (line breaks, tabs, ESC and CSI, which
# start terminal escape sequences) in what `kubectl get` and logs print.
PRINTABLE_LINE = r"^[^\x00-\x1f\x7f-\x9f]+$"
# A git revision (commit hash, tag, branch, `refs/pr/N`) that no command reads as an option:
# starts with a letter, digit or `_`, never with `-`.
GIT_REVISION = r"^[A-Za-z0-9_][-A-Za-z0-9_.+/]*$"

ShortName = Annotated[str, Field(min_length=1, max_length=MAX_NAME, pattern=DNS1123_SUBDOMAIN)]
Text = Annotated[str, Field(min_length=1, max_length=MAX_TEXT)]
RelativePath = Annotated[
    str,
    Field(min_length=1, max_length=MAX_TEXT, pattern=r"^[^/].*$"),
]


def require_exactly_one(model: BaseModel, names: tuple[str, ...], also: tuple[str, ...] = ()) -> None:
    """Exactly one of `names` set; `also` are fields that count as set but are refused elsewhere."""
    set_names = [n for n in names + also if getattr(model, n) is not None]
    if len(set_names) != 1:
        spelled = ", ".join(to_camel(n) for n in names)
        found = ", ".join(to_camel(n) for n in set_names) or "none"
        raise ValueError(f"set exactly one of {spelled} (found: {found})")
