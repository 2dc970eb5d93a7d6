"""The error a bad job spec raises, naming its field."""

from __future__ import annotations


class SpecError(ValueError):
    """A bad job spec. ``param`` is the dotted path of the offending field (OpenAI's error ``param``); ``code`` the
    error code the API answers with where it is not the spec's general one (``invalid_integrations``)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param
        self.detail = message
        self.code = code
