"""Entry points: the ``overlap`` command line, and later torchrun and Ray launchers."""
