"""The Dockerfile read as Docker reads it: instructions in order, by stage, with their ENV and
ARG values (tests/test_deploy.py checks them; tests/image_check.py runs them)."""

from __future__ import annotations

import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"

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


def dockerfile() -> list[Instruction]:
    """(INSTRUCTION, arguments) in order."""
    out = []
    for line in logical_lines(DOCKERFILE.read_text()):
        word, _, rest = line.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def docker_stages() -> list[list[Instruction]]:
    stages: list[list[Instruction]] = []
    for instruction in dockerfile():
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


def docker_arg(name: str) -> str:
    for word, args in dockerfile():
        if word == "ARG":
            key, value = arg_pair(args)
            if key == name and value is not None:
                return value
    raise AssertionError(f"the Dockerfile has no ARG {name}")
