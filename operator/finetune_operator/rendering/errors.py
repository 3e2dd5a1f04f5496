"""The one error rendering raises."""

from __future__ import annotations


class RenderError(ValueError):
    """A job and plan that cannot be turned into manifests; `path` names the field at fault."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message
