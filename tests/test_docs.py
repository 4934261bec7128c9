"""The documentation against the project: docs/configuration.md is what the argument parser
generates, the README stays short, and every relative link points at a file (and a heading)
that exists."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 200


def configuration_module():
    spec = importlib.util.spec_from_file_location("configuration_page",
                                                  ROOT / "docs" / "configuration.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_page_is_what_the_parser_generates():
    page = configuration_module()
    assert page.PAGE.read_text() == page.page(), (
        f"docs/configuration.md differs from what gateway/cli.py's parser generates: "
        f"run `{page.COMMAND}` and commit the page")


def test_configuration_page_lists_every_flag_of_prefixgate_help():
    """Against the real `--help` output too, not only the parser object the page reads."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXGATE_")}
    env["COLUMNS"] = "10000"  # no flag cut at a line end
    shown = subprocess.run([sys.executable, "-m", "gateway", "--help"], cwd=ROOT, env=env,
                           capture_output=True, text=True, check=True).stdout
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", shown)) - {"--help"}
    page = (ROOT / "docs" / "configuration.md").read_text()
    listed = set(re.findall(r"`(--[a-z][a-z0-9-]*)", page))
    assert len(flags) > 40
    assert flags <= listed, (f"missing from docs/configuration.md: {sorted(flags - listed)}; "
                             f"run `{configuration_module().COMMAND}`")


def test_configuration_notes_are_kept_for_flags_the_parser_has():
    page = configuration_module()
    try:
        page.NOTES["--no-such-flag"] = "a note"
        raised = False
        try:
            page.page()
        except KeyError as exc:
            raised = "--no-such-flag" in str(exc)
        assert raised, "a note for a flag the parser lacks must stop the generator"
    finally:
        page.NOTES.pop("--no-such-flag", None)


def test_readme_fits_on_a_few_screens():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move the detail to docs/ "
        f"and link to it")


def documents() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md",
            *sorted((ROOT / "docs").rglob("*.md"))]


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")


def links(path: Path) -> list[str]:
    text = CODE.sub("", FENCE.sub("", path.read_text()))
    return [target for target in LINK.findall(text)
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, mailto: ...


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens, and a
    repeated one numbered."""
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", FENCE.sub("", path.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in found:
            n += 1
            candidate = f"{slug}-{n}"
        found.add(candidate)
    found |= set(re.findall(r"<a (?:name|id)=\"([^\"]+)\"", path.read_text()))
    return found


def test_every_relative_link_points_at_a_file_and_heading_that_exist():
    broken = []
    for doc in documents():
        if not doc.exists():
            continue
        for target in links(doc):
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_link_check_sees_a_broken_link_and_heading(tmp_path):
    (tmp_path / "a.md").write_text("# Top `x`\n\n## Engine modes\n\n[ok](#engine-modes) "
                                   "[ok](a.md#top-x) [bad](b.md) [bad](#nowhere)\n"
                                   "```\n[skipped](c.md)\n```\n")
    doc = tmp_path / "a.md"
    assert links(doc) == ["#engine-modes", "a.md#top-x", "b.md", "#nowhere"]
    assert anchors(doc) == {"top-x", "engine-modes"}
