"""Per-rank peak memory and time of one sequence-parallel scoring step: sp_size 1 (one process) against sp_size 2 (two
processes, gloo, CPU).

The op, on every rank: ``SharingSession("group", sequence_parallel=...)``'s ``score(model, ids, mask, C)`` on one
micro-batch (1 prompt of P real tokens, G completions of C tokens: B = G rows; completions end with EOS and are
right-padded), then ``(log_probs * completion_mask).sum().backward()`` into freshly ``None``-ed parameter gradients.
With sp_size 1 the process runs the ordinary prompt-once path (no process group); with sp_size k > 1 every pass is
split along the sequence over the k ranks of ``torch.distributed.run`` (``grpo_mem.model.sequence_parallel``): each
rank runs about P / k prompt tokens and G·C / k completion tokens through the backbone, exchanges each layer's
attention over the group, and gets the whole (G, C) log-probs back. ``--split`` picks how the passes are cut:
``zigzag`` (the default: 2k chunks, rank r holds chunks r and 2k − 1 − r, the same causal attention work on every
rank), ``contiguous`` (k shards in order: the later rank's queries see more keys), or both; ``--exchange`` how
attention reaches the other ranks' K/V: ``heads`` (the default: an all-to-all to the whole pass at 1/k of the heads,
each rank recording 1/k of the K/V) or ``gather`` (each layer's K/V all-gathered whole on every rank), or both. Each
combination is its own launch against the same sp_size 1 run.

Model (``MODEL``, built from its config, nothing downloaded): Llama-shaped, hidden 256, 4 layers, 4 heads, 2 KV heads
(head_dim 64), intermediate 688, vocab 4096, untied embeddings, random weights (seed 0, the same on every rank),
fp32, SDPA attention, train mode, gradient checkpointing OFF (every layer's activations are saved, so the activation
memory is the part that sequence parallelism divides). One thread per rank (``OMP_NUM_THREADS=1``,
``torch.set_num_threads(1)``), so a rank has the same CPU in both cases.

Measured per rank (``grpo_mem.bench.measure``), after a warm-up step at a tiny size on the same code path:

- ``wall_time``, ``cpu_time`` and ``peak_rss_above_base`` of one step (``measure_once``: the process's peak RSS minus
  its RSS just before the step; weights and inputs are in the base, the gradients the step creates are not);
- ``peak_tensor`` (unless ``--no-tensors``): a second step under ``TensorMemoryTracker``, the largest total of live
  tensor storages the step created (slower: a Python hook per operator).

Beside them, the analytic expectation (``expected``): saved activations of the rank's tokens
(``grpo_mem.bench.estimate.activation_bytes``, fp32, checkpointing off) plus the parameter gradients (the fused
head's workspace is not counted). Under sp_size k the activations fall to about 1/k; the recorded K/V of the whole
prompt and completion pass and the gradients of the prompt's K/V (``gathered_kv``: ``prompt_kv + kv_transient`` of
``activation_bytes``, its share of the expectation in the table) fall to 1/k under the head exchange and stay whole
on every rank under the all-gather. Each run saves its (G, C) log-probs; the sp_size k log-probs are compared with sp_size 1's (max
|diff| in the ``config`` column and the table), and so is the norm of the gradient summed over the ranks.

Rows go to ``benchmarks/results/sp.csv`` (the harness's long format, one set per rank; a re-run of the same shape
replaces its rows). ``--busy`` marks them as measured while other processes shared the cores (the times then mean
little; the memory does not depend on it).

Usage (from the repository root)::

    python benchmarks/bench_sp.py                      # P=16384, C=256, G=8, sp_size 1 and 2 -> results/sp.csv
    python benchmarks/bench_sp.py --prompt-length 8192 # another prompt length
    python benchmarks/bench_sp.py --quick              # P=512, C=32: a smoke run of a few seconds per launch
    python benchmarks/bench_sp.py -P 4096 --split zigzag,contiguous  # both splits against one sp_size 1 run
    python benchmarks/bench_sp.py -P 4096 --exchange heads,gather    # both exchanges against one sp_size 1 run
    python benchmarks/bench_sp.py --table              # reprint the table from the CSV
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path.insert(0, _ROOT)  # the checkout's grpo_mem: the script measures the code beside it

from grpo_mem.bench import harness, isolate  # noqa: E402
from grpo_mem.bench.sweep import merge_csv  # noqa: E402

OP = "sp_scoring_step"
CSV_PATH = os.path.join(_HERE, "results", "sp.csv")
SP_SIZES = (1, 2)
DEFAULT = dict(P=16384, C=256, G=8)
QUICK = dict(P=512, C=32, G=8)
MODEL = dict(
    model_type="llama",
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=688,
    vocab_size=4096,
    tie_word_embeddings=False,
)
WARMUP = dict(P=64, C=8)  # the warm-up step's shape: same path, same collectives, negligible memory


def model_spec(P: int, C: int) -> dict:
    """``MODEL`` with ``max_position_embeddings`` covering P + C tokens."""
    return dict(MODEL, max_position_embeddings=max(2048, P + C))


def make_inputs(P: int, C: int, G: int, vocab: int, seed: int = 0):
    """(ids (G, P + C) int64, mask (G, P + C) int64 0/1, completion mask (G, C) int64 0/1): one prompt of P real tokens
    (no padding) repeated over G rows, each followed by its own completion (``grpo_mem.bench.group.random_completion``:
    length uniform in [C/2, C], EOS last, right-padded)."""
    import torch

    from grpo_mem.bench.group import random_completion

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (P,), generator=g)
    ids, masks = [], []
    for _ in range(G):
        comp, cmask = random_completion(C, vocab, g)
        ids.append(torch.cat([prompt, comp]))
        masks.append(torch.cat([torch.ones(P, dtype=torch.long), cmask]))
    ids, mask = torch.stack(ids), torch.stack(masks)
    return ids, mask, mask[:, -C:]


def expected(P: int, C: int, G: int, sp_size: int, exchange: str = "heads") -> dict[str, float]:
    """The analytic expectation of one rank's peak, in bytes: ``activations`` (``activation_bytes``'s parts for this
    model, fp32, checkpointing off, K/V exchanged as ``exchange`` says), of which ``gathered_kv`` (``prompt_kv +
    kv_transient``: the recorded K/V and the prompt K/V's gradients, full size on every rank under the all-gather,
    1/sp_size under the head exchange); ``gradients`` (the parameters', fp32)."""
    from grpo_mem.bench.estimate import activation_bytes, model_shape

    shape = model_shape(model_spec(P, C))
    parts = activation_bytes(
        shape, method="grpo_mem", P=P, C=C, G=G, sp_size=sp_size, width=4, checkpointing=False, exchange=exchange
    )
    out = {
        "activations": sum(parts.values()),
        "gathered_kv": parts["prompt_kv"] + parts["kv_transient"],
        "gradients": shape.n_params * 4,
    }
    out["total"] = out["activations"] + out["gradients"]
    return out


# --------------------------------------------------------------------------------------------------------- worker
def worker(
    sp_size: int, P: int, C: int, G: int, tensors: bool, out_dir: str, split: str = "zigzag", exchange: str = "heads"
) -> None:
    """One rank: build the model, warm up, measure one step (and one under the tensor tracker), then write this
    rank's measurement and the log-probs to ``out_dir`` (``rank{r}.json``; rank 0 also ``logps.pt``: the (G, C) fp32
    log-probs and the norm of the gradient summed over the ranks)."""
    import torch
    import torch.distributed as dist

    from grpo_mem import SharingSession
    from grpo_mem.bench.group import build_model
    from grpo_mem.bench.measure import TensorMemoryTracker, measure_once, release_free_memory
    from grpo_mem.model.sequence_parallel import SequenceParallel

    torch.set_num_threads(1)
    group = None
    if sp_size > 1:
        dist.init_process_group("gloo")
        if dist.get_world_size() != sp_size:
            raise ValueError(f"sp_size {sp_size} needs as many processes, got world size {dist.get_world_size()}")
        group = SequenceParallel.of(dist.group.WORLD, split=split, exchange=exchange)
    rank = dist.get_rank() if group is not None else 0
    model = build_model(model_spec(P, C), seed=0)
    vocab = model.config.vocab_size
    session = SharingSession("group", sequence_parallel=group, confirm=False)
    last = {}

    def step(ids, mask, cmask):
        logps, _ = session.score(model, ids, mask, cmask.shape[1])
        (logps * cmask).sum().backward()
        last["logps"] = logps.detach()

    def zero():
        model.zero_grad(set_to_none=True)

    inputs = make_inputs(P, C, G, vocab)
    zero()
    step(*make_inputs(WARMUP["P"], WARMUP["C"], G, vocab, seed=1))
    m = measure_once(lambda: step(*inputs), setup=zero)
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    if tensors:
        zero()
        release_free_memory()
        with TensorMemoryTracker() as tracker:
            step(*inputs)
        m.peak_tensor_bytes.append(tracker.peak_bytes)
    if group is not None:
        for g in grads:
            dist.all_reduce(g)  # what DeepSpeed does under sequence parallelism: the sum over the SP group
    grad_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(m.to_dict(), f)
    if rank == 0:
        torch.save({"logps": last["logps"], "grad_norm": grad_norm}, os.path.join(out_dir, "logps.pt"))
    if group is not None:
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # past the last collective: no interpreter teardown (see tests/distributed/launch.py)


# ---------------------------------------------------------------------------------------------------------- parent
def launch(
    sp_size: int,
    P: int,
    C: int,
    G: int,
    tensors: bool,
    out_dir: str,
    timeout: float | None = None,
    split="zigzag",
    exchange="heads",
) -> None:
    """Run ``worker`` in ``sp_size`` fresh processes (one plain process for sp_size 1, ``torch.distributed.run``
    otherwise), one thread each, passes cut as ``split`` says (``sequence_parallel.SPLITS``), K/V exchanged as
    ``exchange`` says (``sequence_parallel.EXCHANGES``); results land in ``out_dir``.

    Raises:
        RuntimeError: a process exited non-zero (the end of its stderr in the message).
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=_ROOT, TOKENIZERS_PARALLELISM="false")
    script = [os.path.abspath(__file__), "--worker", str(sp_size), "--prompt-length", str(P)]
    script += ["--completion-length", str(C), "-G", str(G), "--out-dir", out_dir, "--split", split]
    script += ["--exchange", exchange]
    script += [] if tensors else ["--no-tensors"]
    if sp_size == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={sp_size}"]
        cmd += ["--master_addr=127.0.0.1", f"--master_port={isolate.free_port()}", *script]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"sp_size {sp_size} run exited with code {proc.returncode}:\n{proc.stderr[-3000:]}")


def _row_key(r: dict) -> tuple:
    """What one CSV row measures: provider, metric, P, C, G, split, exchange, rank."""
    c = r["config"]
    return (r["provider"], r["metric"], c["P"], c["C"], c["G"], _split(c), _exchange(c), c["rank"])


def _run_name(k: int, split: str, exchange: str) -> str:
    """A run's directory: ``sp{k}``, with ``-{split}`` for a split other than zigzag and ``-{exchange}`` for an
    exchange other than heads."""
    return f"sp{k}" + ("" if split == "zigzag" else f"-{split}") + ("" if exchange == "heads" else f"-{exchange}")


def _rank_rows(out: str, k: int, P: int, config: dict) -> list[dict]:
    """The CSV rows of the ``k`` ranks of one run whose measurements ``rank{r}.json`` are in ``out``, each with
    ``config`` and its ``rank``."""
    rows = []
    for r in range(k):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            m = json.load(f)
        rows += harness.measurement_rows(OP, f"sp{k}", "full", "P", P, m, dict(config, rank=r))
    return rows


def run(
    P: int,
    C: int,
    G: int,
    sp_sizes,
    *,
    tensors: bool,
    busy: bool,
    csv_path: str,
    out_root: str | None = None,
    splits=("zigzag",),
    exchanges=("heads",),
):
    """Launch every sp_size (each sp_size > 1 once per split of ``splits`` and exchange of ``exchanges``), compare its
    log-probs and summed gradient norm with the first (sp_size 1), and merge the rows into ``csv_path``. Returns the
    rows written. ``out_root``: where each run's files are kept (``sp{k}/``, with ``-{split}`` for a split other than
    zigzag and ``-{exchange}`` for an exchange other than heads); a temporary directory when None."""
    import torch

    rows = []
    runs = [(k, "zigzag", "heads") if k == 1 else (k, s, e) for k in sp_sizes for s in splits for e in exchanges]
    runs = list(dict.fromkeys(runs))
    with tempfile.TemporaryDirectory() as tmp:
        root = out_root or tmp
        ref = None
        for k, split, exchange in runs:
            out = os.path.join(root, _run_name(k, split, exchange))
            os.makedirs(out, exist_ok=True)
            launch(k, P, C, G, tensors, out, split=split, exchange=exchange)
            saved = torch.load(os.path.join(out, "logps.pt"))
            if ref is None:
                ref = saved
            diff = float((saved["logps"] - ref["logps"]).abs().max())
            grad_rel = abs(saved["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"]
            exp = expected(P, C, G, k, exchange)
            config = dict(
                P=P,
                C=C,
                G=G,
                B=G,
                sp_size=k,
                split=split if k > 1 else "-",
                exchange=exchange if k > 1 else "-",
                model="llama-h256-l4",
                dtype="float32",
                checkpointing=False,
                threads=1,
                busy=busy,
                logp_max_abs_diff_vs_sp1=diff,
                grad_norm_rel_diff_vs_sp1=grad_rel,
                grad_norm=saved["grad_norm"],
                expected_mb=round(exp["total"] / harness.MB, 1),
                expected_gathered_kv_mb=round(exp["gathered_kv"] / harness.MB, 1),
            )
            rows += _rank_rows(out, k, P, config)
    merge_csv(rows, csv_path, _row_key)
    return rows


def _split(config: dict) -> str:
    """How a row's passes were cut: its ``split`` (rows written before the zigzag split were contiguous)."""
    return config.get("split", "contiguous" if config["sp_size"] > 1 else "-")


def _exchange(config: dict) -> str:
    """How a row's attention reached other ranks' K/V: its ``exchange`` (rows written before the head exchange
    all-gathered)."""
    return config.get("exchange", "gather" if config["sp_size"] > 1 else "-")


def table(path: str = CSV_PATH) -> str:
    """Markdown table of the CSV: per (shape, sp_size, split, rank), time, CPU time, peak RSS above base, peak live
    tensors, the expectation and its gathered-K/V part, the RSS over sp_size 1's, and the log-prob difference to
    sp_size 1."""
    by = {}
    for r in harness.read_csv(path):
        c = r["config"]
        key = (c["P"], c["C"], c["G"], c["sp_size"], _split(c), _exchange(c), c["rank"])
        by.setdefault(key, {"config": c})[r["metric"]] = r["p50"]
    out = []
    for (P, C, G, k, split, exchange, rank), v in sorted(by.items()):
        c = v["config"]
        base = by.get((P, C, G, 1, "-", "-", 0), {}).get("peak_rss_above_base", math.nan)
        rss = v.get("peak_rss_above_base", math.nan)
        out.append(
            [
                f"{P}, {C}, {G}",
                k,
                split,
                exchange,
                rank,
                v.get("wall_time"),
                v.get("cpu_time"),
                rss,
                v.get("peak_tensor"),
                c["expected_mb"],
                f"{c['expected_gathered_kv_mb']:.0f} ({c['expected_gathered_kv_mb'] / c['expected_mb']:.0%})",
                f"{rss / base:.2f}",
                f"{c['logp_max_abs_diff_vs_sp1']:.1e}",
                "busy" if c.get("busy") else "quiet",
            ]
        )
    headers = [
        "P, C, G",
        "sp_size",
        "split",
        "exchange",
        "rank",
        "time (s)",
        "CPU time (s)",
        "peak RSS above base (MB)",
        "live tensors (MB)",
        "expected (MB)",
        "of which gathered K/V (MB)",
        "RSS / sp1",
        "max |logp diff| vs sp1",
        "machine",
    ]
    return harness.markdown_table(headers, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-length", "-P", type=int, help=f"prompt tokens (default {DEFAULT['P']})")
    ap.add_argument("--completion-length", "-C", type=int, help=f"completion tokens (default {DEFAULT['C']})")
    ap.add_argument("-G", type=int, help=f"completions per prompt (default {DEFAULT['G']})")
    ap.add_argument("--sp-sizes", default=",".join(map(str, SP_SIZES)), help="comma-separated, first is the reference")
    ap.add_argument("--quick", action="store_true", help=f"a small shape {QUICK} (smoke run)")
    ap.add_argument(
        "--split",
        default="zigzag",
        help="how sp_size > 1 cuts the passes: zigzag (default), contiguous, or both comma-separated (one run each)",
    )
    ap.add_argument(
        "--exchange",
        default="heads",
        help="how sp_size > 1 attention reaches other ranks' K/V: heads (default), gather, or both comma-separated",
    )
    ap.add_argument("--no-tensors", action="store_true", help="skip the second step under the tensor tracker")
    ap.add_argument("--busy", action="store_true", help="mark the rows as measured on a busy machine")
    ap.add_argument("--csv", default=CSV_PATH, help="the CSV to merge the rows into")
    ap.add_argument("--out-dir", help="keep each run's log-probs and measurements here (sp{k}/)")
    ap.add_argument("--table", action="store_true", help="reprint the table from the CSV and exit")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    shape = dict(QUICK if args.quick else DEFAULT)
    for key, value in (("P", args.prompt_length), ("C", args.completion_length), ("G", args.G)):
        if value is not None:
            if value < 1:
                ap.error(f"{key} must be >= 1, got {value}")
            shape[key] = value
    splits, exchanges = tuple(args.split.split(",")), tuple(args.exchange.split(","))
    if args.worker is not None:
        worker(
            args.worker, shape["P"], shape["C"], shape["G"], not args.no_tensors, args.out_dir, splits[0], exchanges[0]
        )
        return 0
    if args.table:
        print(table(args.csv))
        return 0
    sp_sizes = [int(s) for s in args.sp_sizes.split(",")]
    if not splits or any(s not in ("zigzag", "contiguous") for s in splits):
        ap.error(f"--split must be zigzag, contiguous or both comma-separated, got {args.split!r}")
    if not exchanges or any(e not in ("heads", "gather") for e in exchanges):
        ap.error(f"--exchange must be heads, gather or both comma-separated, got {args.exchange!r}")
    if sp_sizes[0] != 1 or any(k < 1 for k in sp_sizes):
        ap.error(f"--sp-sizes must start with 1 and hold sizes >= 1, got {args.sp_sizes!r}")
    run(
        **shape,
        sp_sizes=sp_sizes,
        tensors=not args.no_tensors,
        busy=args.busy,
        csv_path=args.csv,
        out_root=args.out_dir,
        splits=splits,
        exchanges=exchanges,
    )
    print(table(args.csv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
