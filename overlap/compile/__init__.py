"""The compile pipeline: a fusion becomes the host program every rank runs.

``compile_program`` runs the passes listed in ``overlap.compile.pipeline.PASSES``, each a
module of this room; ``overlap.compile.dump`` prints the result for a named device. The
same on every rank, with no process group (never imports ``runtime`` or ``comm``).
"""

from overlap.compile.pipeline import CompiledProgram, compile_program

__all__ = ["CompiledProgram", "compile_program"]
