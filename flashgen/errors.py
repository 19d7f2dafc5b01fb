"""Exceptions that carry an actionable message for the user."""


class FlashgenError(Exception):
    """Base class for flashgen's own errors."""


class ToolchainError(FlashgenError):
    """A compiler, header set or package that the build needs is missing."""


class BuildError(FlashgenError):
    """One or more kernels failed to build; the message names them and their logs."""


class UnsupportedError(FlashgenError):
    """No kernel in the package can serve this call; the message says what would."""
