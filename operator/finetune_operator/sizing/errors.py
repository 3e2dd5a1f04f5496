"""The error types sizing raises for bad input."""

from __future__ import annotations


class SizingError(ValueError):
    """Bad sizing input. The message always names the offending field."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message  # without the field: for callers that name the field in the job's terms
        super().__init__(f"{field}: {message}")


class UnknownArchitecture(SizingError):
    """The config names a `model_type` the analytic model does not know.

    Not a defect of the job: the model may be perfectly valid, only this estimator cannot
    size it. Callers that can measure instead (the pre-flight profile) catch this class and
    profile the model; callers that cannot report it like any SizingError (field
    `model_type`, or `family` when a ModelArchitecture is built directly). `model_type` is the name the config gave (None or a non-string when the
    config has none), `known` the families the analytic model does size.
    """

    def __init__(self, model_type: object, known: tuple[str, ...], field: str = "model_type"):
        self.model_type = model_type
        self.known = tuple(known)
        if model_type is None:
            what = "the config names no model_type"
        else:
            what = f"unknown family {model_type!r}"
        super().__init__(
            field,
            f"{what}: the analytic memory model sizes only {', '.join(self.known)}; "
            "a model of another family needs a measured profile",
        )
