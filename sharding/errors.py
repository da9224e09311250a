"""Errors of the sharding layer."""

from fusion.errors import DefinitionError


class ShardingError(DefinitionError):
    """Layouts that cannot hold: conflicting annotations, a tensor used off its mesh, ..."""
