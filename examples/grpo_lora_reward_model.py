"""GRPO with a PEFT LoRA adapter and a reward model beside a reward function, scored by grpo_mem.

    python examples/grpo_lora_reward_model.py
    python examples/grpo_lora_reward_model.py --model path/to/policy --reward-model path/to/rm --max-steps 2

As in TRL's GRPO documentation, ``reward_funcs`` mixes a sequence-classification reward model (a hub id or a local
directory: TRL loads it with ``AutoModelForSequenceClassification.from_pretrained(..., num_labels=1)`` and its own
tokenizer) and a Python function; TRL adds their rewards. The policy is trained through a LoRA adapter
(``peft_config``); the reference log-probs come from the same model with the adapter disabled, which grpo_mem scores
too. ``lora_dropout`` is 0: active dropout is a fallback cause (a prompt forwarded once for its group would share one
dropout mask among its completions), so a LoRA with dropout trains on TRL's own path.

The prompts are built in memory (reasoning-gym's chain_sum, as in ``grpo_basic.py``): nothing is downloaded but the
two models.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from grpo_basic import chain_sum_dataset, correct_answer, logged_grpo_mem  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct", help="policy: hub id or local directory")
    p.add_argument(
        "--reward-model",
        default="Skywork/Skywork-Reward-V2-Qwen3-0.6B",
        help="sequence-classification reward model: hub id or local directory",
    )
    p.add_argument("--output-dir", default="grpo-lora-rm")
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--per-device-train-batch-size", type=int, default=16)
    p.add_argument("--max-completion-length", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--beta", type=float, default=0.04, help="KL coefficient (reference = adapter disabled)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    import torch
    from peft import LoraConfig
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
        beta=args.beta,
        temperature=0.7,
        bf16=bf16,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
    )
    peft_config = LoraConfig(
        r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )

    grpo_mem.patch_trl()
    trainer = GRPOTrainer(
        model=args.model,
        reward_funcs=[args.reward_model, correct_answer],
        args=config,
        train_dataset=chain_sum_dataset(args.num_prompts, args.seed),
        peft_config=peft_config,
    )

    report = grpo_mem.verify(trainer, raise_on_mismatch=True)
    print(f"verify: passed={report.passed} max |dlogp|={report.max_logp_diff:.2e} grad rel={report.grad_rel_diff:.2e}")

    trainer.train()
    trainer.save_model(args.output_dir)  # the adapter
    trainer.save_state()

    steps = logged_grpo_mem(trainer.state.log_history)
    for i, entry in enumerate(steps, 1):
        print(f"step {i}: " + " ".join(f"{k}={v:.4g}" for k, v in sorted(entry.items())))
    if not steps or not all(math.isfinite(s.get("loss", math.nan)) for s in steps):
        print("no finite loss with grpo_mem metrics was logged")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
