"""Errors raised by the IR. Each message names the op, the tensors and the mismatch."""


class FusionError(ValueError):
    """Base class of every error the fusion IR raises on bad input."""


class DefinitionError(FusionError):
    """An op, an output or a tensor definition is invalid (raised when it is added)."""


class InputError(FusionError):
    """Execution inputs do not match the fusion (raised before anything runs)."""
