"""Command-line flags generated from a settings dataclass (``transformers.HfArgumentParser``), and back.

A field ``steps: int = 16`` with ``metadata={"help": "..."}`` becomes ``--steps N``; a ``bool`` field with default
``True`` (``patch``) becomes ``--patch [BOOL]`` plus ``--no-patch``. On top of ``HfArgumentParser`` this module:

- keeps one spelling per flag, the hyphenated one (``--max-completion-length``; HfArgumentParser also adds
  ``--max_completion_length``), so ``--help`` and error messages name each flag once;
- lets ``metadata["type"]`` choose the conversion (HfArgumentParser always uses the annotation), so a flag can check
  its value while parsing: :func:`int_at_least`, :func:`positive_int`, :func:`non_negative_int`,
  :func:`num_generations`, :func:`json_dict`;
- turns the settings back into a command line (:func:`to_argv`) for running the same settings in a child process;
- checks an output directory before the work (:func:`check_output_dir`).

Importing this module loads only the standard library; :func:`settings_parser` imports ``transformers`` (not torch),
so a caller can force Hugging Face's offline variables before that first import.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import tempfile
import typing
from typing import Any


def int_at_least(lo: int, why: str = ""):
    """argparse type: an integer >= ``lo`` (the error names the bound and the value, then ``why`` if given)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {value}" + (f": {why}" if why else ""))
        return value

    return parse


positive_int = int_at_least(1)
"""argparse type: an integer >= 1."""
non_negative_int = int_at_least(0)
"""argparse type: an integer >= 0."""
num_generations = int_at_least(
    2, "GRPO requires at least 2 generations per prompt to calculate the advantages (as TRL's GRPOConfig says)"
)
"""argparse type of ``--num-generations`` (G): an integer >= 2, refused below with the reason TRL's ``GRPOConfig``
gives."""


def check_output_dir(path, flag: str = "--output-dir") -> None:
    """Check, before any work, that the directory ``path`` can take a run's files: it is a directory this process can
    create a file in, or it does not exist and its nearest existing ancestor is such a directory. Creates nothing
    (a probe file is made and removed in that directory), so a run refused later leaves no directory behind.

    Raises:
        ValueError: on one line, ``"<flag> <path> is not writable (<why>)"``: a file or a broken link is in the way
            (``path`` itself or an ancestor), or the directory refuses a new file (the system's reason: permission
            denied, read-only file system).
    """
    target = os.path.abspath(os.path.expanduser(os.fspath(path)))
    existing = target
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        what = "a file" if os.path.exists(existing) else "a broken link"
        raise ValueError(f"{flag} {path} is not writable ({existing} is {what}, not a directory)")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise ValueError(f"{flag} {path} is not writable ({existing}: {exc.strerror or exc})") from None


def json_dict(text: str) -> dict:
    """argparse type: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show a flag's default unless it is None, False or empty (those helps say the default in words)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == {} or action.help is None:
            return action.help
        return super()._get_help_string(action)


def settings_parser(settings_type, **kwargs) -> argparse.ArgumentParser:
    """``HfArgumentParser`` for one settings dataclass, with one hyphenated spelling per flag and
    ``metadata["type"]`` honoured (see the module docstring). Its ``parse_settings(argv)`` returns the instance.

    Args:
        settings_type: the dataclass; each field's ``metadata["help"]`` is its help text.
        **kwargs: passed to ``argparse.ArgumentParser`` (``prog``, ``description``, ...); the formatter defaults to
            :class:`DefaultsFormatter`.
    """
    return _parser_class()(settings_type, **kwargs)


@functools.cache
def _parser_class():
    from transformers import HfArgumentParser

    class SettingsParser(HfArgumentParser):
        def __init__(self, settings_type, **kwargs):
            # Set before HfArgumentParser adds the fields (argparse's own -h goes through add_argument before that).
            self._settings_fields = {f.name: f for f in dataclasses.fields(settings_type) if f.init}
            self._settings_hints = typing.get_type_hints(settings_type)
            kwargs.setdefault("formatter_class", DefaultsFormatter)
            super().__init__(settings_type, **kwargs)

        def add_argument(self, *flags, **kwargs):
            fields = getattr(self, "_settings_fields", None)
            longs = [f for f in flags if f.startswith("--")]
            name = kwargs.get("dest") or (longs[0][2:].replace("-", "_") if longs else None)
            field = fields.get(name) if fields is not None else None
            if field is not None:
                flags = tuple(
                    f for f in flags if not (f.startswith("--") and "_" in f and f.replace("_", "-") in flags)
                )
                if kwargs.get("action") == "store_false":  # HfArgumentParser's --no-X complement of a bool X
                    kwargs["help"] = f"same as --{name.replace('_', '-')} false"
                elif self._settings_hints.get(name) in (bool, bool | None):
                    kwargs.setdefault("metavar", "BOOL")
                elif "type" in field.metadata:
                    kwargs["type"] = field.metadata["type"]
            return super().add_argument(*flags, **kwargs)

        def parse_settings(self, argv: list[str] | None = None):
            """Parse ``argv`` (default ``sys.argv[1:]``) into one settings instance; exit with status 2 on a bad
            flag, and on a ``ValueError`` from the instance's ``validate()`` (if it has one), printing its message."""
            settings, rest = self.parse_args_into_dataclasses(
                args=argv, look_for_args_file=False, return_remaining_strings=True
            )
            if rest:
                self.error(f"unrecognized arguments: {' '.join(rest)}")
            validate = getattr(settings, "validate", None)
            if validate is not None:
                try:
                    validate()
                except ValueError as exc:
                    self.error(str(exc))
            return settings

    return SettingsParser


def to_argv(settings) -> list[str]:
    """The flags that make :func:`settings_parser` rebuild ``settings``: one ``--flag=value`` per field that differs
    from its default (bools as ``true``/``false``, dicts as JSON; one token each, so a value starting with ``-``
    stays a value).

    Raises:
        ValueError: a field holds ``None`` where its default is not ``None`` (no flag can say that).
    """
    argv: list[str] = []
    for f in dataclasses.fields(settings):
        if not f.init:
            continue
        value = getattr(settings, f.name)
        if f.default is not dataclasses.MISSING:
            default: Any = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        if value == default and type(value) is type(default):
            continue
        if value is None:
            raise ValueError(f"{f.name} is None but defaults to {default!r}; no flag can set that")
        flag = f"--{f.name.replace('_', '-')}"
        if isinstance(value, bool):
            argv.append(f"{flag}={'true' if value else 'false'}")
        elif isinstance(value, dict):
            argv.append(f"{flag}={json.dumps(value)}")
        else:
            argv.append(f"{flag}={value}")
    return argv
