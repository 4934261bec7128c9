"""Each model's own settings, from a preset file (`--models-preset`), as llama-server's router
reads its INI presets: a section per model id, and `[*]` for every model; a key is one of
prefixgate's own flags without its dashes, a value what the flag takes (`ctx-size = 8192`,
`temperature = 0.7`, `model-alias = coder, coder-*`, `speculation = off`, a switch as `true` or
`false`). The command line's flags are what every model inherits; `[*]` is read over them, then
the model's own section.

A section may name its model's file (`model = /srv/gguf/qwen.gguf`): that file is served as the
section's id, beside --model's and --models-dir's (a file they serve already takes the section's
name instead of its stem); or a model on the hub (`hf-repo = owner/name:Q4_K_M`, and `hf-file`
if need be), downloaded as --hf-repo's are. Only a model's own settings may be set there
(threads, context, sequences, workers, aliases, chat template, sampling, speculation, offload,
its share of the pool): a server's (port, keys, Redis...) in a preset is an error naming the
section and key."""

from __future__ import annotations

import argparse
import configparser
import copy
from dataclasses import dataclass
from pathlib import Path

EVERY_MODEL = "*"
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
FILE_KEYS = ("model", "hf-repo", "hf-file")  # which file a section serves, not its flags


class PresetError(ValueError):
    """The preset file cannot be used: its message names the file, section and key."""


@dataclass(frozen=True)
class Presets:
    path: Path
    sections: dict[str, dict[str, str]]  # id (or `*`) -> key -> value

    @classmethod
    def read(cls, path: Path, model_flags: frozenset[str]) -> Presets:
        """`model_flags`: the flags (without dashes) a model may set for itself."""
        ini = configparser.ConfigParser(interpolation=None, default_section="\0none")
        ini.optionxform = str  # keys as written: flags are lower case, an error names it
        try:
            with path.open() as f:
                ini.read_file(f)
        except (OSError, configparser.Error) as exc:
            raise PresetError(f"--models-preset {path}: {exc}") from None
        sections = {name: dict(ini[name]) for name in ini.sections()}
        for name, values in sections.items():
            for key in values:
                if key not in model_flags and not (key in FILE_KEYS and name != EVERY_MODEL):
                    raise PresetError(f"--models-preset {path} [{name}]: {key!r} is not a "
                                      f"model's own setting (a model may set "
                                      f"{', '.join(sorted(model_flags))}"
                                      f"{'' if name == EVERY_MODEL else ', '}"
                                      f"{'' if name == EVERY_MODEL else ', '.join(FILE_KEYS)})")
            if "hf-file" in values and "hf-repo" not in values or \
                    "model" in values and "hf-repo" in values:
                raise PresetError(f"--models-preset {path} [{name}]: a model's file is `model` "
                                  f"or `hf-repo` (with `hf-file` if need be), one of them")
        return cls(path, sections)

    def model_files(self) -> dict[str, Path]:
        """The sections that name their model's file: id -> the file (relative to the
        preset's directory)."""
        return {name: self.path.parent / values["model"]
                for name, values in self.sections.items() if "model" in values}

    def hub_models(self) -> dict[str, tuple[str, str | None]]:
        """The sections that name a model on the hub: id -> (`hf-repo`, `hf-file` or None)."""
        return {name: (values["hf-repo"], values.get("hf-file"))
                for name, values in self.sections.items() if "hf-repo" in values}

    def check_served(self, ids: list[str]) -> None:
        for name in self.sections:
            if name != EVERY_MODEL and name not in ids:
                raise PresetError(f"--models-preset {self.path} [{name}]: no model {name!r} "
                                  f"is served (served: {', '.join(ids)}); give the section "
                                  f"`model = <file>` to serve one")

    def apply(self, parser: argparse.ArgumentParser, inherited: argparse.Namespace,
              model: str) -> argparse.Namespace:
        """The flags of `model`: `inherited` (the command line's), then `[*]`, then its own
        section; argparse checks and converts each value as on the command line."""
        args = copy.deepcopy(inherited)
        options = parser._option_string_actions
        for name in (EVERY_MODEL, model):
            tokens: list[str] = []
            for key, value in self.sections.get(name, {}).items():
                if key in FILE_KEYS:
                    continue
                action = options[f"--{key}"]
                if action.nargs == 0:  # a switch: `true` is the flag given, `false` not
                    if self._switch(name, key, value):
                        setattr(args, action.dest, action.const)
                    elif isinstance(action, argparse._StoreTrueAction):
                        setattr(args, action.dest, False)
                elif isinstance(action, argparse._AppendAction):  # replaces what it inherits
                    setattr(args, action.dest, [])
                    for item in filter(None, (v.strip() for v in value.split(","))):
                        tokens += [f"--{key}", item]
                else:
                    tokens += [f"--{key}", value]
            parser.exit_on_error = False
            try:
                parser.parse_args(tokens, namespace=args)
            except argparse.ArgumentError as exc:
                raise PresetError(f"--models-preset {self.path} [{name}]: {exc}") from None
            finally:
                parser.exit_on_error = True
        return args

    def _switch(self, section: str, key: str, value: str) -> bool:
        if value.lower() not in TRUE + FALSE:
            raise PresetError(f"--models-preset {self.path} [{section}]: {key} is a switch: "
                              f"true or false, not {value!r}")
        return value.lower() in TRUE
