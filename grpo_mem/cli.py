"""Command line: ``grpo-mem COMMAND ...`` (``grpo-mem --help`` lists the commands, ``grpo-mem train --help`` the flags).

Process-wide settings, made here before anything imports torch or a Hugging Face library (``import grpo_mem`` loads
neither: its names resolve on first use):

- OpenMP wait policy. With its default (active, spinning) wait, libgomp's threads burn their time slices at every
  parallel region's barrier whenever another process shares the cores; measured here on 2 cores with other jobs
  running, 2 steps of the tiny test model took 11.7 s per step with the default policy and 1.3 s with
  ``OMP_WAIT_POLICY=PASSIVE``. libgomp reads the variable once, when torch loads it, so this module sets
  ``OMP_WAIT_POLICY=PASSIVE`` in ``os.environ`` on import unless the variable is already set (set it to ``ACTIVE``
  to keep spinning threads). Child processes (``train --compare``'s runs) inherit it.
- Offline: ``HF_HUB_OFFLINE=1`` (and the transformers/datasets equivalents) are forced before any Hugging Face
  library is imported.

Commands live in their own modules, each with ``main(argv) -> int``; :data:`COMMANDS` lists them and only the chosen
one is imported.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # first: see the module docstring

import argparse  # noqa: E402
import importlib  # noqa: E402
import sys  # noqa: E402

import grpo_mem  # noqa: E402  (imports nothing heavy: its names resolve on first use)

from grpo_mem.commands.gguf_models import force_offline  # noqa: E402  (imports nothing heavy)

force_offline()

COMMANDS: dict[str, tuple[str, str]] = {
    "train": (
        "grpo_mem.commands.train",
        "GRPO on a reasoning-gym task, TRL's GRPOTrainer patched by grpo_mem (CUDA in bf16 when available, else CPU)",
    ),
    "bench": ("grpo_mem.commands.bench", "will grpo_mem help on my model? stock TRL vs grpo_mem on one scoring step"),
}
"""Command name -> (module defining ``main(argv: list[str]) -> int``, one-line help)."""

CLI_EXTRA = ("reasoning_gym", "gguf", "datasets", "matplotlib")
"""Top-level modules of the ``cli`` extra's packages (setup.py): the commands need them, the library does not."""


def missing_cli_modules() -> list[str]:
    """The modules of :data:`CLI_EXTRA` that cannot be imported (looked up, not imported)."""
    import importlib.util

    def importable(name: str) -> bool:
        if name in sys.modules:
            return sys.modules[name] is not None
        return importlib.util.find_spec(name) is not None

    return [name for name in CLI_EXTRA if not importable(name)]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: names the commands (each command parses its own flags) and prints ``--version``
    (``grpo_mem.__version__``, the version setup.py installs)."""
    parser = argparse.ArgumentParser(
        prog="grpo-mem",
        description="grpo_mem's command line: memory-lean GRPO with TRL.",
        epilog="Run `grpo-mem COMMAND --help` for a command's flags.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {grpo_mem.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``grpo-mem`` console script: run ``COMMAND`` with the rest of ``argv`` (default
    ``sys.argv[1:]``) and return its exit status; 2, with a message naming the extra to install, when a module of
    the ``cli`` extra (:data:`CLI_EXTRA`) is missing (``--help`` works without them)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        build_parser().parse_args(argv)  # prints the help or the error and exits
        return 2
    module_name, _ = COMMANDS[argv[0]]
    missing = [] if {"-h", "--help"} & set(argv) else missing_cli_modules()
    if missing:
        print(
            f"grpo-mem {argv[0]}: error: {', '.join(missing)} not installed; the commands need the cli extra: "
            'pip install "grpo_mem[cli]"',
            file=sys.stderr,
        )
        return 2
    return importlib.import_module(module_name).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
