"""The package's version: the one ``pip`` installs (pyproject reads it here) and ``--version`` prints."""

__version__ = "0.1.0"
