"""GRPO with TRL's GRPOTrainer, scored by grpo_mem: a dataset, a reward function, GRPOConfig, patch_trl, verify, train.

    python examples/grpo_basic.py                                  # SmolLM2-135M-Instruct from the hub, 10 steps
    python examples/grpo_basic.py --model path/to/model --max-steps 2 --output-dir out

The prompts are reasoning-gym's ``chain_sum`` questions (sums of two one-digit numbers), built in memory: nothing is
downloaded but the model. The reward is 1 when the last number of the completion is the answer, else 0.

What grpo_mem adds to TRL's logs, per logged step: ``grpo_mem/token_ratio`` (tokens the backbone ran over what
stock TRL runs), ``grpo_mem/backbone_tokens``, ``grpo_mem/stock_tokens``, and ``grpo_mem/path/tree``, ``/group``,
``/stock`` (the fraction of micro-batches on each path). The script prints them at the end.
"""

from __future__ import annotations

import argparse
import math
import re

SYSTEM_PROMPT = "You are a calculator. Reply with only the resulting number."


def chain_sum_dataset(size: int, seed: int):
    """``size`` conversational prompts of reasoning-gym's chain_sum task with their ``answer`` column (strings)."""
    import reasoning_gym
    from datasets import Dataset

    entries = reasoning_gym.create_dataset(
        "chain_sum", size=size, seed=seed, min_terms=2, max_terms=2, min_digits=1, max_digits=1
    )
    rows = [
        {
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": e["question"]}],
            "answer": e["answer"],
        }
        for e in entries
    ]
    return Dataset.from_list(rows)


def correct_answer(completions, answer, **kwargs) -> list[float]:
    """1.0 where the completion's last integer equals the dataset's ``answer`` column, else 0.0. TRL passes the
    dataset's other columns as keyword arguments; conversational completions are lists of messages."""
    rewards = []
    for completion, target in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        numbers = re.findall(r"-?\d+", text)
        rewards.append(1.0 if numbers and numbers[-1] == str(target).strip() else 0.0)
    return rewards


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct", help="hub id or local directory")
    p.add_argument("--output-dir", default="grpo-basic")
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--num-prompts", type=int, default=64, help="dataset size")
    p.add_argument("--num-generations", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--per-device-train-batch-size", type=int, default=16, help="completions per micro-batch")
    p.add_argument("--max-completion-length", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=2e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 autocast (default: on when a CUDA GPU supports it; fp32 on CPU)",
    )
    return p.parse_args(argv)


def logged_grpo_mem(log_history: list[dict]) -> list[dict]:
    """The logged steps' loss and grpo_mem metrics, one dict per logged step."""
    return [
        {k: v for k, v in entry.items() if k == "loss" or k.startswith("grpo_mem/")}
        for entry in log_history
        if "grpo_mem/token_ratio" in entry
    ]


def main(argv=None) -> int:
    args = parse_args(argv)

    import torch
    from trl import GRPOConfig, GRPOTrainer

    import grpo_mem

    bf16 = args.bf16 if args.bf16 is not None else torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        num_generations=args.num_generations,
        per_device_train_batch_size=args.per_device_train_batch_size,
        max_completion_length=args.max_completion_length,
        learning_rate=args.learning_rate,
        temperature=0.7,
        bf16=bf16,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
    )

    grpo_mem.patch_trl()  # before building the trainer: GRPOTrainer (and RLOOTrainer) score through grpo_mem
    trainer = GRPOTrainer(
        model=args.model,
        reward_funcs=correct_answer,
        args=config,
        train_dataset=chain_sum_dataset(args.num_prompts, args.seed),
    )

    # One generation batch scored by stock TRL and by grpo_mem, with gradients; prints a table and raises
    # grpo_mem.patches.verify_criteria.VerificationError on a mismatch. Leaves the trainer as it was.
    report = grpo_mem.verify(trainer, raise_on_mismatch=True)
    print(f"verify: passed={report.passed} max |dlogp|={report.max_logp_diff:.2e} grad rel={report.grad_rel_diff:.2e}")

    trainer.train()
    trainer.save_model(args.output_dir)
    trainer.save_state()  # output_dir/trainer_state.json holds log_history, grpo_mem's metrics included

    steps = logged_grpo_mem(trainer.state.log_history)
    for i, entry in enumerate(steps, 1):
        print(f"step {i}: " + " ".join(f"{k}={v:.4g}" for k, v in sorted(entry.items())))
    if not steps or not all(math.isfinite(s.get("loss", math.nan)) for s in steps):
        print("no finite loss with grpo_mem metrics was logged")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
