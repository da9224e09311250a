"""What a run did: its timeline (per rank, per stream), the same spans as profiler ranges
(``ranges``), and progress messages on the ``overlap`` logger.

Imports nothing else of ``overlap``: every other room may record into it.
"""

from overlap.diag.timeline import Span, Timeline

__all__ = ["Span", "Timeline"]
