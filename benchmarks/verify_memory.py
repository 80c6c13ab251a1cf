"""Peak memory of ``grpo_mem.verify`` against the patched training step it checks, on a long shared system prompt.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/verify_memory.py [--model qwen2] [--dtype bfloat16] [--system 1000]
        [--prompts 8] [--generations 8] [--completion 16] [--micro-batch 8] [--modes step,step_adamw,verify]
        [--csv benchmarks/results/verify_memory.csv]

The batch: ``--prompts`` prompts, each a ``--system``-token system prompt shared by all of them plus a question of
8-24 own tokens (left-padded to the longest), ``--generations`` completions each of 8 to ``--completion`` random
tokens ending in EOS (right-padded), rows shuffled as TRL shuffles its generation batch; random weights of the
``grpo_mem.bench.presets.BENCH_MODELS`` shape ``--model`` in ``--dtype``.

Each mode runs in a fresh process and is measured the way ``grpo_mem.bench.measure`` measures an op (``measure_once``:
the peak RSS above the RSS before the call, with glibc's mmap threshold fixed so RSS follows live memory; and, in the
same call with ``--track``, the peak of tensor storages alive at once, ``TensorMemoryTracker``, several times slower).
Parameters start without ``.grad``. ``--repo DIR`` imports ``grpo_mem`` from another checkout (the state before a
change).

- ``step``: the patched training step, as ``patch_trl`` runs it in a gradient-accumulation window of
  ``rows / --micro-batch`` micro-batches: the patched ``_get_per_token_logps_and_entropies`` per micro-batch (prompts
  shared through the window's ``SharingSession``), each followed by the backward of TRL's token-level loss.
- ``step_adamw``: the same, then ``torch.optim.AdamW.step()`` (the first step of training creates its two moments).
- ``verify``: ``grpo_mem.verify(model, batch, micro_batch_size=--micro-batch)``.

Prints one line per mode and appends rows (mode, peak_rss_mb, peak_tensor_mb, seconds, settings) to ``--csv``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODES = ("step", "step_adamw", "verify")


def make_batch(system: int, prompts: int, generations: int, completion: int, vocab: int, seed: int = 0) -> dict:
    """TRL's layout of the benchmark's batch (see the module docstring): int64 ``prompt_ids``/``prompt_mask``
    (rows, P) left-padded and ``completion_ids``/``completion_mask`` (rows, C) right-padded, rows shuffled."""
    import torch

    from grpo_mem.bench.presets import EOS_ID, PAD_ID

    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, vocab, (system,), generator=g)
    own = [
        torch.randint(3, vocab, (int(torch.randint(8, 25, (1,), generator=g)),), generator=g) for _ in range(prompts)
    ]
    P = system + max(len(q) for q in own)
    rows_p, rows_pm, rows_c, rows_cm = [], [], [], []
    for q in own:
        ids = torch.cat([head, q])
        pad = P - len(ids)
        for _ in range(generations):
            n = int(torch.randint(max(1, completion // 2), completion + 1, (1,), generator=g))
            comp = torch.full((completion,), PAD_ID)
            comp[:n] = torch.randint(3, vocab, (n,), generator=g)
            comp[n - 1] = EOS_ID
            rows_p.append(torch.cat([torch.full((pad,), PAD_ID), ids]))
            rows_pm.append(torch.cat([torch.zeros(pad, dtype=torch.long), torch.ones(len(ids), dtype=torch.long)]))
            rows_c.append(comp)
            rows_cm.append((torch.arange(completion) < n).long())
    perm = torch.randperm(len(rows_p), generator=g)
    stack = lambda rows: torch.stack(rows)[perm]  # noqa: E731
    return dict(
        prompt_ids=stack(rows_p),
        prompt_mask=stack(rows_pm),
        completion_ids=stack(rows_c),
        completion_mask=stack(rows_cm),
    )


def patched_step(model, batch: dict, micro: int, optimizer=None) -> None:
    """One gradient-accumulation window of the patched method (see ``step``), then ``optimizer.step()`` if given."""
    import torch
    import trl

    from grpo_mem.patches.trl import patched_method
    from grpo_mem.patches.verify_inputs import Scorer, stock_method

    self_obj = Scorer(model, 1.0)
    fn, handle = patched_method(stock_method(trl.GRPOTrainer))
    session = handle.session(self_obj)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    P, C, B = batch["prompt_ids"].shape[1], batch["completion_ids"].shape[1], ids.shape[0]
    slices = [(lo, min(lo + micro, B)) for lo in range(0, B, micro)]
    session.begin_window([ids[lo:hi, :P] for lo, hi in slices], [mask[lo:hi, :P] for lo, hi in slices])
    adv = torch.randn(B, generator=torch.Generator().manual_seed(0))
    n_tok = batch["completion_mask"].sum().clamp_min(1).float()
    try:
        for lo, hi in slices:
            logps, ent, _ = fn(self_obj, model, ids[lo:hi], mask[lo:hi], C, batch_size=hi - lo, compute_entropy=True)
            m = batch["completion_mask"][lo:hi].float()
            loss = -(adv[lo:hi, None] * m * logps.float()).sum() / n_tok - 0.1 * (m * ent.float()).sum() / n_tok
            loss.backward()
    finally:
        session.close_window()
    if optimizer is not None:
        optimizer.step()


def worker(args: dict) -> dict:
    """Measure one mode in this process; returns {peak_rss_mb, peak_tensor_mb, seconds, passed}."""
    import torch

    import grpo_mem
    from grpo_mem.bench import measure
    from grpo_mem.bench.group import build_model
    from grpo_mem.bench.presets import bench_model_config

    torch.set_num_threads(args["threads"])
    model = build_model(bench_model_config(args["model"]), dtype=args["dtype"])
    batch = make_batch(
        args["system"], args["prompts"], args["generations"], args["completion"], model.config.vocab_size
    )
    # warm-up: lazy imports and one-time installs on a tiny batch of the same model, gradients dropped afterwards
    tiny = make_batch(16, 2, 2, 4, model.config.vocab_size, seed=1)
    patched_step(model, tiny, 2)
    grpo_mem.verify(model, tiny, micro_batch_size=2, print_report=False)
    model.zero_grad(set_to_none=True)
    out = {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6) if args["mode"] == "step_adamw" else None

    def op():
        if args["mode"] == "verify":
            report = grpo_mem.verify(model, batch, micro_batch_size=args["micro"], print_report=False)
            out["passed"] = report.passed
            out["report"] = str(report)
        else:
            patched_step(model, batch, args["micro"], optimizer)

    tracker = measure.TensorMemoryTracker() if args["track"] else contextlib.nullcontext()

    def tracked():
        with tracker:
            op()

    m = measure.measure_once(tracked)
    out.update(
        peak_rss_mb=m.peak_rss_above_base_bytes[0] / measure.MB,
        peak_tensor_mb=tracker.peak_bytes / measure.MB if args["track"] else float("nan"),
        seconds=m.times_s[0],
        rows=int(batch["prompt_ids"].shape[0]),
        prompt_width=int(batch["prompt_ids"].shape[1]),
    )
    return out


def _revision(repo: str) -> str:
    """The checkout's short commit, "+changes" when its tracked files differ from it."""
    git = ["git", "-C", repo]
    rev = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    dirty = subprocess.run([*git, "diff", "--quiet", "HEAD"], check=False).returncode
    return rev.stdout.strip() + ("+changes" if dirty else "")


def build_parser() -> argparse.ArgumentParser:
    """The command line's flags (see the module docstring); ``--worker`` is the fresh process's own."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--system", type=int, default=1000, help="tokens of the shared system prompt")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--completion", type=int, default=16, help="completion width")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--track", action="store_true", help="also track tensor storages (TensorMemoryTracker; several times slower)"
    )
    parser.add_argument("--repo", default=None, help="import grpo_mem from this checkout (default: this one)")
    parser.add_argument("--csv", default=None, help="append the rows to this CSV")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser


def run_mode(mode: str, settings: dict, repo: str) -> dict | None:
    """``mode`` measured in a fresh process importing ``grpo_mem`` from ``repo``; prints its line (and verify's
    report) and returns its CSV row, or None (the process's output printed to stderr) when the process failed."""
    env = dict(os.environ, PYTHONPATH=repo)
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(dict(settings, mode=mode))],
        capture_output=True,
        text=True,
        env=env,
    )
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not result:
        print(proc.stdout[-4000:], proc.stderr[-4000:], file=sys.stderr)
        return None
    r = json.loads(result[-1][len("RESULT ") :])
    if "report" in r:
        print(r.pop("report"))
    print(
        f"{mode}: peak RSS {r['peak_rss_mb']:.0f} MB, peak tensors {r['peak_tensor_mb']:.0f} MB above base, "
        f"{r['seconds']:.1f} s ({r['rows']} rows, prompt width {r['prompt_width']})",
        flush=True,
    )
    row = dict(mode=mode, **{k: r[k] for k in ("peak_rss_mb", "peak_tensor_mb", "seconds")}, **settings)
    row["passed"] = r.get("passed", "")
    return row


def append_rows(path: str, rows: list[dict]) -> None:
    """Append ``rows`` to the CSV at ``path``, with a header line first when the file is new."""
    path = Path(path)
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new:
            writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker is not None:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        parser.error(f"unknown modes {bad}; choose from {list(MODES)}")
    repo = args.repo or str(Path(__file__).resolve().parents[1])
    settings = dict(
        model=args.model,
        dtype=args.dtype,
        system=args.system,
        prompts=args.prompts,
        generations=args.generations,
        completion=args.completion,
        micro=args.micro_batch,
        threads=args.threads,
        track=args.track,
        checkout=_revision(repo),
    )
    rows = []
    for mode in modes:
        row = run_mode(mode, settings, repo)
        if row is None:
            return 1
        rows.append(row)
    if args.csv:
        append_rows(args.csv, rows)
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    sys.exit(main())
