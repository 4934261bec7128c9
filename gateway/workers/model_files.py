"""Which GGUF files a gateway serves (`--model`, given any number of times, and every GGUF under
`--models-dir`), and the id each is served by: its file's stem, as llama-server's router names
them. A model split over several files (llama.cpp's gguf-split names them
NAME-00001-of-00003.gguf) is one model, NAME, loaded from its first part: llama.cpp finds the
others beside it. Multimodal projectors (mmproj*.gguf) are no models of their own."""

from __future__ import annotations

import re
from pathlib import Path

SPLIT_PART = re.compile(r"^(?P<name>.+)-(?P<part>\d{5})-of-(?P<parts>\d{5})$")


class ModelsError(ValueError):
    """What is asked cannot be served: its message says which file and why."""


def model_id(path: Path) -> str:
    stem = path.name.removesuffix(".gguf")
    split = SPLIT_PART.match(stem)
    return split["name"] if split else stem


def served_paths(models: list[Path], models_dir: Path | None) -> list[Path]:
    """The files to load, `models` first in their order, then the directory's by name; each
    id once."""
    for path in models:
        if not path.is_file():
            raise ModelsError(f"--model {path}: no such file")
    found = list(models)
    if models_dir is not None:
        if not models_dir.is_dir():
            raise ModelsError(f"--models-dir {models_dir}: no such directory")
        in_dir = [path for path in sorted(models_dir.rglob("*.gguf"))
                  if path.is_file() and _is_model(path)]
        if not in_dir:
            raise ModelsError(f"--models-dir {models_dir}: no GGUF file in it")
        found += in_dir
    served: dict[Path, Path] = {}  # a file reached twice (a link, given and in the directory)
    by_id: dict[str, Path] = {}
    for path in found:
        if served.setdefault(path.resolve(), path) is not path:
            continue
        if (other := by_id.setdefault(model_id(path), path)) is not path:
            raise ModelsError(f"{other} and {path} would both be served as "
                              f"{model_id(path)!r}: rename one")
    return list(served.values())


def _is_model(path: Path) -> bool:
    """A file of its own or a split model's first part; no projector."""
    if path.name.startswith("mmproj"):
        return False
    split = SPLIT_PART.match(path.name.removesuffix(".gguf"))
    return split is None or int(split["part"]) == 1
