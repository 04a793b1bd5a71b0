"""Errors that describe a user's mistake. Each message says what was wrong and how to fix it."""


class SpecfleetError(Exception):
    """Base class: the CLI prints these without a traceback and exits non-zero."""


class ModelLoadError(SpecfleetError):
    """A model path is missing, a file is corrupt or truncated, or a checksum does not match."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint describes an architecture or feature specfleet does not implement."""


class InvalidRequestError(SpecfleetError, ValueError):
    """Bad sampling parameters, a prompt longer than the context, and similar request errors."""
