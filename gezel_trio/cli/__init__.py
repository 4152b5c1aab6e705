"""The ``gezel-trio`` command line: :mod:`.main` (``serve`` and the engine and model
commands), :mod:`.client` (the commands that talk to a running host) and
:mod:`.logging_setup` (text or JSON logs)."""

from .main import main

__all__ = ["main"]
