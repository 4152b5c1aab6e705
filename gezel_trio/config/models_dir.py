"""Models from a folder (``[engine] models_dir``, ``serve --models-dir``), as llama-server's
router reads its ``--models-dir``.

- Every ``*.gguf`` file directly in the folder is a model; its id is the file name
  without ``.gguf``.
- A split model (``name-00001-of-00003.gguf`` ...) is one model, ``name``, served from
  its first part (llama-server loads the others from there). A split whose parts are
  not all present yet (a download in progress) is left out until they are.
- A subfolder holding one model (one file or one split) is that model, with the
  subfolder's name as its id; an ``mmproj*.gguf`` file beside it is its multimodal
  projector (``--mmproj``). Deeper folders are not read.
- Files whose names start with ``.`` and partial downloads (``*.part``,
  ``*.download``) are ignored.

Ids are stable: the same files give the same ids. Should a subfolder and a file give
one id (``qwen/`` and ``qwen.gguf``), the file keeps it and the subfolder's model gets
``-1`` (the first free ``-N``). A ``[[models]]`` entry whose
``path`` is the same file (after resolving links) wins over the folder's, and so does
one with the same id. :func:`scan_models_dir` only reads the folder; nothing here
starts an engine.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path

from .schema import ModelConfig

__all__ = ["models_from_dir", "scan_models_dir"]

log = logging.getLogger("gezel_trio.config.models_dir")

_SPLIT = re.compile(r"(?P<name>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf")


def _is_model_file(path: Path) -> bool:
    name = path.name
    return (
        path.is_file()
        and name.endswith(".gguf")
        and not name.startswith(".")
        and not name.lower().startswith("mmproj")
    )


def _models_in(files: Sequence[Path]) -> list[tuple[str, Path]]:
    """(id, first file) of each whole model among ``files`` (one folder's)."""
    out: list[tuple[str, Path]] = []
    splits: dict[str, dict[int, Path]] = {}
    counts: dict[str, int] = {}
    for f in sorted(files):
        m = _SPLIT.fullmatch(f.name)
        if m is None:
            out.append((f.name[: -len(".gguf")], f))
            continue
        name = m["name"]
        splits.setdefault(name, {})[int(m["part"])] = f
        counts[name] = int(m["count"])
    for name, parts in sorted(splits.items()):
        if set(parts) == set(range(1, counts[name] + 1)):
            out.append((name, parts[1]))
        else:
            log.info(
                "models_dir: %s has %d of %d parts: not served yet", name, len(parts), counts[name]
            )
    return out


def scan_models_dir(folder: str | os.PathLike[str]) -> list[ModelConfig]:
    """The models in ``folder`` (see the module docstring), sorted by id. A folder that
    does not exist has none. Blocking file I/O."""
    root = Path(folder)
    if not root.is_dir():
        return []
    found: list[ModelConfig] = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            inner = [f for f in entry.iterdir() if _is_model_file(f)]
            models = _models_in(inner)
            if len(models) != 1:
                if models:
                    log.info("models_dir: %s holds %d models, expected one", entry, len(models))
                continue
            mmproj = sorted(
                f
                for f in entry.iterdir()
                if f.is_file() and f.name.lower().startswith("mmproj") and f.name.endswith(".gguf")
            )
            args = ["--mmproj", str(mmproj[0])] if mmproj else []
            found.append(ModelConfig(id=entry.name, path=str(models[0][1]), args=args))
        elif _is_model_file(entry):
            continue  # collected below, with the folder's other files (splits)
    top = [f for f in root.iterdir() if _is_model_file(f)]
    found += [ModelConfig(id=model_id, path=str(path)) for model_id, path in _models_in(top)]
    found.sort(key=lambda m: (m.id, m.path or ""))
    taken: set[str] = set()
    for i, model in enumerate(found):  # "qwen.gguf" sorts before "qwen/...": it keeps "qwen"
        model_id, n = model.id, 0
        while model_id in taken:
            n += 1
            model_id = f"{model.id}-{n}"
        taken.add(model_id)
        if model_id != model.id:
            found[i] = dataclasses.replace(model, id=model_id)
    return sorted(found, key=lambda m: m.id)


def models_from_dir(explicit: Sequence[ModelConfig], folder: str | None) -> list[ModelConfig]:
    """``explicit`` (the ``[[models]]`` entries) plus the folder's models that no explicit
    entry names by id or by file. Blocking file I/O."""
    out = list(explicit)
    if not folder:
        return out
    ids = {m.id for m in explicit}
    files = {os.path.realpath(m.path) for m in explicit if m.path}
    for model in scan_models_dir(folder):
        assert model.path is not None
        if model.id in ids or os.path.realpath(model.path) in files:
            continue
        out.append(model)
    return out
