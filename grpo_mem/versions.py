"""The transformers, TRL and accelerate releases grpo_mem was tested on, and what a release outside them gets.

``TESTED`` is the one definition of the tested ranges: ``setup.py`` reads its lower bounds as the install
requirements (as text: importing the package at build time would need its dependencies), docs/compatibility.md states
the ranges, and ``tests/test_install.py`` checks all three agree. There is no upper bound in the requirements, so pip
never replaces a user's transformers or TRL with an older one. A release outside a range is served as follows:

- transformers: a warning once per process (``UntestedReleaseWarning``, naming the installed release and the tested
  range), and the run-time confirmation (``grpo_mem.model.confirm``) stays on whatever ``confirm=False`` or
  ``GRPO_MEM_CONFIRM=0`` say: only the model classes whose tiny copy matches its own forward on the prompt-once path
  take that path, every other falls back to the stock path with a named cause.
- accelerate: a warning once per process. grpo_mem replaces two steps of accelerate's setup (the sequence- and
  context-parallel preparation, ``grpo_mem.patches.trl_sp``) and reads its distributed state; a release that changed
  them is one no test has run.
- TRL: a warning once per process; ``patch_trl`` then patches only if the methods it replaces have the signatures it
  was written against and the trainer has the attributes it reads (``grpo_mem.patches.checks``), and refuses
  (``TypeError``, naming the difference) otherwise. TRL older than the range is refused (``RuntimeError``).

This module imports neither transformers nor TRL until a function asks for the installed release.
"""

from __future__ import annotations

import functools
import importlib
import warnings

__all__ = ["TESTED", "UntestedReleaseWarning", "check_tested", "installed", "is_tested", "minimum"]

TESTED: dict[str, str] = {
    "transformers": ">=5.23,<5.26",
    "trl": ">=1.10,<1.17",
    "accelerate": ">=1.15,<1.17",
}
"""Package -> the PEP 440 range of releases the whole suite was run on (docs/compatibility.md)."""


class UntestedReleaseWarning(UserWarning):
    """An installed transformers, TRL or accelerate release lies outside ``TESTED``."""


_warned: set[str] = set()


def _check_package(package: str) -> None:
    if package not in TESTED:
        raise ValueError(f"grpo_mem has no tested range for package {package!r}; known: {', '.join(sorted(TESTED))}")


def installed(package: str) -> str:
    """The installed release of ``package`` ("transformers", "trl" or "accelerate"): its module's ``__version__``.

    Raises:
        ValueError: ``package`` is not a key of ``TESTED``.
        ModuleNotFoundError: the package is not installed.
    """
    _check_package(package)
    return importlib.import_module(package).__version__


def minimum(package: str) -> tuple[int, ...]:
    """The lowest tested release of ``package`` (the ``>=`` bound of its range) as a tuple of ints, e.g. (1, 10)."""
    _check_package(package)
    for spec in TESTED[package].split(","):
        if spec.startswith(">="):
            return tuple(int(p) for p in spec[2:].split("."))
    raise ValueError(f"the tested range of {package} has no >= bound: {TESTED[package]!r}")


def is_tested(package: str, version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed release) of ``package`` lies in its tested range. A pre-release or
    development build of a tested release counts as in range (``5.24.0.dev0``).

    Raises:
        ValueError: ``package`` is not a key of ``TESTED``.
    """
    _check_package(package)
    return _in_range(TESTED[package], installed(package) if version is None else version)


@functools.cache
def _in_range(spec: str, version: str) -> bool:
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(spec).contains(version, prereleases=True)


def check_tested(package: str) -> bool:
    """Whether the installed ``package`` lies in its tested range; if not, warn once per process
    (``UntestedReleaseWarning``) naming the installed release, the tested range and what grpo_mem does with it."""
    version = installed(package)
    if is_tested(package, version):
        return True
    if package not in _warned:
        _warned.add(package)
        what = {
            "transformers": "every model class is confirmed on a tiny copy before it takes the prompt-once path "
            "(confirm=False and GRPO_MEM_CONFIRM=0 are overridden); a class that does not match falls back to "
            "the stock path with the cause",
            "trl": "patch_trl checks the signatures of the methods it replaces and the trainer attributes it reads "
            "and refuses a release that changed them; run grpo_mem.verify(trainer) on your model before a long run",
            "accelerate": "its distributed setup (FSDP2, DeepSpeed, sequence and context parallelism) has not been run "
            "with grpo_mem; run grpo_mem.verify(trainer) on your setup before a long run",
        }[package]
        warnings.warn(
            f"grpo_mem: {package} {version} is outside the tested range {package}{TESTED[package]} "
            f"(docs/compatibility.md): {what}",
            UntestedReleaseWarning,
            stacklevel=3,
        )
    return False
