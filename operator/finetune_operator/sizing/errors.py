"""The one error type sizing raises for bad input."""


class SizingError(ValueError):
    """Bad sizing input. The message always names the offending field."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")
