"""The documentation against the project: docs/configuration.md is what the argument parser
generates."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
