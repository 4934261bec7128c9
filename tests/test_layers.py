"""The house by process: gateway/ (the HTTP process) over engine/ (the worker process) over
cache/ (blocks, tokens and bytes), read from the source's imports: no import from a lower layer
back up, no circle, aiohttp and llama.cpp each on one side only, and inside gateway/ no API's
package importing another's.

`python -m tests.test_layers` draws the house: each room (folder), its modules (a package's
docstring-only __init__ aside) and lines, and its floors (a module's floor is the longest chain
of project imports below it; 0 imports nothing)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("gateway", "engine", "cache")  # each may import only those after it
# One package per API over the one generation path (gateway/core/): none imports another's.
# Dynamo's token-level generate endpoint is one more (gateway/dynamo/).
API_PACKAGES = ("gateway.openai", "gateway.anthropic", "gateway.responses", "gateway.dynamo")
PURE_PYTHON_HELPERS = ("llama_cpp.llama_chat_format", "llama_cpp.llama_grammar")


def modules() -> dict[str, Path]:
    found = {}
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, *, runtime_only: bool = False) -> set[str]:
    """Modules `path` imports; `runtime_only` leaves out what only type checkers see."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    if runtime_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped |= {id(n) for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def project_imports(path: Path, known: dict[str, Path], **kw) -> set[str]:
    return {name for name in imports(path, **kw) if name in known}


def test_no_import_from_a_lower_layer_back_up():
    known = modules()
    for name, path in known.items():
        rank = LAYERS.index(name.split(".")[0])
        for target in project_imports(path, known):
            assert LAYERS.index(target.split(".")[0]) >= rank, f"{name} imports {target}"


def test_no_import_circle():
    known = modules()
    graph = {name: project_imports(path, known) - {name} for name, path in known.items()}
    state: dict[str, str] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for target in graph[name]:
            if state.get(target) == "open":
                pytest.fail("import circle: " + " -> ".join([*trail, name, target]))
            if target not in state:
                visit(target, [*trail, name])
        state[name] = "done"

    for name in graph:
        if name not in state:
            visit(name, [])


def test_http_and_llama_cpp_live_on_different_sides():
    for name, path in modules().items():
        found = imports(path)
        if "aiohttp" in found:
            assert name.startswith("gateway."), f"{name} imports aiohttp"
        # The binding itself. The gateway takes only llama-cpp-python's pure-Python helpers:
        # the Jinja chat-template renderer and the JSON-schema-to-grammar converter.
        binding = {n for n in found if n.split(".")[0] == "llama_cpp" and n != "llama_cpp"
                   and not n.startswith(PURE_PYTHON_HELPERS)}
        if binding or "llama_cpp" in _plain_imports(path):
            assert name == "engine.llama", f"{name} binds llama.cpp: engine/llama.py only"
        if _calls(path, "llama_decode"):
            assert name.startswith("engine."), f"{name} calls llama_decode"


def _plain_imports(path: Path) -> set[str]:
    return {alias.name for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Import) for alias in node.names}


def _calls(path: Path, function: str) -> bool:
    return any(isinstance(node, ast.Call) and function in (getattr(node.func, "attr", None),
                                                           getattr(node.func, "id", None))
               for node in ast.walk(ast.parse(path.read_text())))


def test_the_messages_between_processes_load_no_llama_cpp():
    known = modules()
    seen, todo = set(), ["engine.messages"]
    while todo:
        name = todo.pop()
        seen.add(name)
        todo += [t for t in project_imports(known[name], known, runtime_only=True)
                 if t not in seen]
        assert "llama_cpp" not in imports(known[name]), f"{name} (for engine.messages)"
    assert "engine.llama" not in seen


def test_the_plain_gateway_loads_none_of_the_dynamo_extra():
    """Dynamo and the tokenizers its model directory is written with are the `dynamo` extra:
    the images install the gateway without it, so serving must not import them."""
    extra = ("dynamo", "tokenizers", "gguf", "transformers")
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, gateway.server, gateway.cli; "
         f"print(sorted(set({extra!r}) & sys.modules.keys()))"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"


def test_no_folder_holds_a_worker_and_a_workers_module():
    for package in LAYERS:
        names = {p.name for p in (ROOT / package).glob("*.py")}
        assert not {"worker.py", "workers.py"} <= names, package


def _api_package(name: str) -> str | None:
    return next((p for p in API_PACKAGES if name == p or name.startswith(p + ".")), None)


def test_an_api_package_never_imports_another_apis():
    known = modules()
    assert all(package in known for package in API_PACKAGES)
    for name, path in known.items():
        if (home := _api_package(name)) is None:
            continue
        for target in project_imports(path, known):
            assert _api_package(target) in (None, home), f"{name} imports {target}"


def floors(known: dict[str, Path]) -> dict[str, int]:
    """Each module's floor: 0 for one importing no project module, else one above the highest
    module it imports (the graph has no circle: test_no_import_circle)."""
    graph = {name: project_imports(path, known) - {name} for name, path in known.items()}
    found: dict[str, int] = {}

    def floor(name: str) -> int:
        if name not in found:
            found[name] = 1 + max((floor(t) for t in graph[name]), default=-1)
        return found[name]

    for name in graph:
        floor(name)
    return found


def house() -> str:
    known = modules()
    levels = floors(known)
    rooms: dict[str, list[str]] = {}
    for name, path in known.items():
        if path.name != "__init__.py":  # a room's docstring
            rooms.setdefault(str(path.parent.relative_to(ROOT)), []).append(name)
    rows = ["| room | modules | lines | floors |", "|---|---:|---:|---|"]
    for room, names in sorted(rooms.items()):
        lines = sum(len(known[n].read_text().splitlines()) for n in names)
        low, high = min(levels[n] for n in names), max(levels[n] for n in names)
        rows.append(f"| {room}/ | {len(names)} | {lines} | {low}-{high} |")
    modules_count = sum(len(names) for names in rooms.values())
    rows.append(f"\n{modules_count} modules on {max(levels.values()) + 1} floors")
    return "\n".join(rows)


if __name__ == "__main__":
    print(house())
