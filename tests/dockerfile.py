"""The Dockerfiles read as Docker reads them: instructions in order, by stage, with their ENV and
ARG values (tests/test_deploy.py checks them; tests/image_check.py runs the CPU one)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
CUDA_DOCKERFILE = ROOT / "Dockerfile.cuda"

Instruction = tuple[str, str]  # (INSTRUCTION, its arguments)


def logical_lines(text: str, comment: str = "#") -> list[str]:
    """Lines with backslash continuations joined and comment lines dropped (as Docker and make
    read them)."""
    lines: list[str] = []
    current = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith(comment) or (not current and not stripped):
            continue
        if raw.rstrip().endswith("\\"):
            current += raw.rstrip()[:-1]
            continue
        lines.append(current + raw)
        current = ""
    if current:
        lines.append(current)
    return lines


def dockerfile(path: Path = DOCKERFILE) -> list[Instruction]:
    """(INSTRUCTION, arguments) in order."""
    out = []
    for line in logical_lines(path.read_text()):
        word, _, rest = line.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def docker_stages(path: Path = DOCKERFILE) -> list[list[Instruction]]:
    stages: list[list[Instruction]] = []
    for instruction in dockerfile(path):
        if instruction[0] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(instruction)
    return stages


def env_pairs(args: str) -> dict[str, str]:
    """An ENV instruction's `key=value` pairs."""
    return dict(part.partition("=")[::2] for part in shlex.split(args))


def arg_pair(args: str) -> tuple[str, str | None]:
    """An ARG instruction's name and default (None without one)."""
    key, has_default, value = args.partition("=")
    return key, " ".join(shlex.split(value)) if has_default else None


def docker_env(stage: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for word, args in stage:
        if word == "ENV":
            env.update(env_pairs(args))
    return env


def docker_arg(name: str, path: Path = DOCKERFILE) -> str:
    for word, args in dockerfile(path):
        if word == "ARG":
            key, value = arg_pair(args)
            if key == name and value is not None:
                return value
    raise AssertionError(f"{path.name} has no ARG {name}")


def base_image(stage: list[Instruction], path: Path = DOCKERFILE) -> str:
    """A stage's FROM image, its ${ARG}s at their defaults."""
    image = shlex.split(stage[0][1])[0]
    return re.sub(r"\$\{?(\w+)\}?", lambda m: docker_arg(m.group(1), path), image)
