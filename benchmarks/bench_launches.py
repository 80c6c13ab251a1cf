"""Launches and host reads, the CPU proxy of GPU launch cost: what one warm scoring forward + backward asks of the
device, stock TRL against grpo_mem's group and tree sharing, per backend of grpo_mem's ops.

    python benchmarks/bench_launches.py                    # -> benchmarks/results/launches.csv and its table
    python benchmarks/bench_launches.py --verbose          # also each provider's 15 most frequent launching ops
    python benchmarks/bench_launches.py --sources          # also where each host read happens (file:line, count)
    python benchmarks/bench_launches.py --table            # reprint the table from the CSV

The call: completion log-probs and entropies of 2 prompts x G=4 completions (P=128: prompts left-padded by P/8 and
P/4, C=32: completions of C/2..C tokens right-padded, rows shuffled as TRL shuffles its generation batch;
``grpo_mem.bench.group.make_inputs``) in one micro-batch, and their backward with fixed random weights, on a random
tiny Llama (hidden 64, MLP 128, 4 query / 2 KV heads, vocabulary 256, tied head, SDPA, fp32, CPU). Providers
(``grpo_mem.bench.launches.scoring_step``): ``trl``, stock TRL 1.16's own ``_get_per_token_logps_and_entropies``
with its fused head; ``grpo_mem_group`` and ``grpo_mem_tree``, a ``grpo_mem.SharingSession`` window as
``patch_trl`` runs it. grpo_mem runs under each backend preference of ``--backends``
(``grpo_mem.ops._backends.set_preference``: ``auto`` picks ATen's fused CPU attention and the C++ head on CPU,
``torch`` the chunked torch code that also runs on CUDA); stock TRL uses none of them (backend ``none``).

Each (provider, backend) runs once to warm up and is counted on its second call (gradients set to None before it,
as ``zero_grad`` leaves them), by ``grpo_mem.bench.launches.count_call``, which defines what counts:

- ``launches_per_layer`` [ops]: ATen ops that launch a kernel (views, metadata-only ops and bare allocations left
  out) per decoder layer: (count with 4 layers - count with 2 layers) / 2;
- ``launches_per_call`` [ops]: the same, the whole call of the 4-layer model;
- ``host_reads_per_call`` [reads]: reads of device data by the host in that call (``item``/``int``/``bool`` of a
  tensor, ops sizing their output from data, ``tolist``/``numpy``), each a stream synchronisation on CUDA;
- ``host_reads_outside_cpu_kernels`` [reads]: those not made inside the CPU-only kernels (ATen's fused CPU attention,
  the C++ head), the reads a GPU run would also make.

Counts do not depend on timing: one run, p50 = p20 = p80. Rows of ``op=launches`` replace the CSV's rows of the same
provider and backend.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))  # the checkout's grpo_mem: the script measures the code beside it

import torch  # noqa: E402

from grpo_mem.bench import results  # noqa: E402
from grpo_mem.bench.group import build_model, make_inputs  # noqa: E402
from grpo_mem.bench.launches import PROVIDERS, Counts, count_call, scoring_step  # noqa: E402

OP = "launches"
CSV_PATH = os.path.join(_HERE, "results", "launches.csv")
MODEL = dict(
    model_type="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
"""The tiny Llama (``num_hidden_layers`` set per count)."""
SHAPE = dict(prompts=2, G=4, P=128, C=32)
LAYERS = (2, 4)
METRICS = (
    ("launches_per_layer", "ops"),
    ("launches_per_call", "ops"),
    ("host_reads_per_call", "reads"),
    ("host_reads_outside_cpu_kernels", "reads"),
)


def count(provider: str, layers: int, shape: dict = SHAPE, model_spec: dict = MODEL) -> Counts:
    """:class:`Counts` of the second call of ``provider``'s scoring step on a fresh ``layers``-layer model (seed 0)
    and the batch of ``shape`` (keys ``prompts``, ``G``, ``P``, ``C``), under the process's backend preference."""
    model = build_model(dict(model_spec, num_hidden_layers=layers))
    ids, mask, _ = make_inputs(shape["G"], shape["P"], shape["C"], shape["prompts"], model_spec["vocab_size"])
    step = scoring_step(provider, model, [(ids, mask)], shape["C"])
    step()  # warm-up: lazy imports, the model's one-time installs, grpo_mem's confirmation
    model.zero_grad(set_to_none=True)
    return count_call(step)


def measure(provider: str, backend: str, shape: dict = SHAPE, model_spec: dict = MODEL) -> dict:
    """Counts of ``provider`` under the backend preference ``backend`` ("none": leave it as it is): the metrics of
    :data:`METRICS` and the :class:`Counts` of the deepest model (``counts``)."""
    from grpo_mem.ops import _backends

    previous = _backends.set_preference(None if backend == "none" else backend)
    try:
        counts = {n: count(provider, n, shape, model_spec) for n in LAYERS}
    finally:
        _backends.set_preference(previous)
    lo, hi = counts[LAYERS[0]], counts[LAYERS[-1]]
    return dict(
        provider=provider,
        backend=backend,
        launches_per_layer=(hi.total_launches - lo.total_launches) / (LAYERS[-1] - LAYERS[0]),
        launches_per_call=hi.total_launches,
        host_reads_per_call=hi.host_reads(),
        host_reads_outside_cpu_kernels=hi.host_reads(outside_cpu_kernels=True),
        counts=hi,
    )


def rows(result: dict, shape: dict = SHAPE, model_spec: dict = MODEL) -> list[dict]:
    """The CSV rows of one :func:`measure` result (columns ``results.CSV_COLUMNS``)."""
    config = dict(
        shape,
        model="llama-tiny",
        hidden=model_spec["hidden_size"],
        heads=model_spec["num_attention_heads"],
        kv_heads=model_spec["num_key_value_heads"],
        vocab=model_spec["vocab_size"],
        backend=result["backend"],
        dtype="fp32",
        threads=torch.get_num_threads(),
    )
    key = dict(
        op=OP,
        provider=result["provider"],
        mode="full",
        x_name="P",
        x_value=shape["P"],
        device=results.device_name(torch.get_num_threads()),
        timestamp=results.now_utc(),
        version=results.versions(),
    )
    out = []
    for metric, unit in METRICS:
        layers = list(LAYERS) if metric == "launches_per_layer" else LAYERS[-1]
        value = result[metric]
        cfg = json.dumps(dict(config, layers=layers), sort_keys=True)
        out.append(dict(key, metric=metric, unit=unit, p50=value, p20=value, p80=value, config=cfg))
    return out


def save(new_rows: list[dict], path: str = CSV_PATH) -> None:
    """Write ``new_rows`` to ``path``, keeping the rows already there of other (op, provider, backend) keys."""

    def key(r):
        cfg = r["config"] if isinstance(r["config"], dict) else json.loads(r["config"])
        return r["op"], r["provider"], cfg.get("backend")

    fresh = {key(r) for r in new_rows}
    kept = []
    if os.path.exists(path):
        for r in results.read_csv(path):
            if key(r) not in fresh:
                kept.append(dict(r, config=json.dumps(r["config"], sort_keys=True)))
    results.write_csv(kept + new_rows, path)


def table(path: str = CSV_PATH) -> str:
    """The markdown table of the CSV at ``path``: one line per (provider, backend), per-layer launches also as a
    multiple of stock TRL's."""
    by_key: dict = {}
    for r in results.read_csv(path):
        if r["op"] == OP:
            by_key.setdefault((r["provider"], r["config"]["backend"]), {})[r["metric"]] = r["p50"]
    stock = next((m["launches_per_layer"] for (p, _), m in by_key.items() if p == "trl"), float("nan"))
    lines = []
    for (provider, backend), m in sorted(by_key.items(), key=lambda kv: (kv[0][0] != "trl", kv[0][1], kv[0][0])):
        lines.append(
            [
                provider,
                backend,
                m["launches_per_layer"],
                m["launches_per_layer"] / stock,
                int(m["launches_per_call"]),
                int(m["host_reads_per_call"]),
                int(m["host_reads_outside_cpu_kernels"]),
            ]
        )
    headers = [
        "provider",
        "backend",
        "launches / layer",
        "x stock",
        "launches / call",
        "host reads",
        "outside CPU kernels",
    ]
    return results.markdown_table(headers, lines, floatfmt=".3g")


def report(result: dict, *, verbose: bool, sources: bool) -> None:
    """Print the most frequent launching ops (``verbose``) and the host reads by source (``sources``) of one
    :func:`measure` result."""
    counts: Counts = result["counts"]
    title = f"{result['provider']} (backend {result['backend']}, {LAYERS[-1]} layers)"
    if verbose:
        top = ", ".join(f"{name} {n}" for name, n in counts.launches.most_common(15))
        print(f"{title}: {counts.total_launches} launching ops, {counts.views} views, {counts.allocs} allocations")
        print(f"  top 15: {top}")
    if sources:
        outside = counts.read_sources(outside_cpu_kernels=True)
        print(f"{title}: {counts.host_reads()} host reads ({counts.host_reads(True)} outside the CPU-only kernels)")
        for (what, where), n in sorted(counts.read_sources().items(), key=lambda kv: (-kv[1], kv[0])):
            mark = "" if (what, where) in outside else "  [CPU-only kernel]"
            print(f"  {n:3d} x {what:<22} {where}{mark}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="auto,torch", help="grpo_mem's backend preferences to count under")
    parser.add_argument("--providers", default=",".join(PROVIDERS), help=f"a subset of {','.join(PROVIDERS)}")
    parser.add_argument("--csv", default=CSV_PATH, help="where the rows go ('' for nowhere)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (counts do not depend on them)")
    parser.add_argument("--verbose", action="store_true", help="each provider's 15 most frequent launching ops")
    parser.add_argument("--sources", action="store_true", help="each host read's source line and count")
    parser.add_argument("--table", action="store_true", help="print the table of --csv and exit")
    args = parser.parse_args(argv)
    if args.table:
        print(table(args.csv))
        return 0
    torch.set_num_threads(args.threads)
    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    bad = [p for p in providers if p not in PROVIDERS]
    if bad:
        parser.error(f"--providers must be a subset of {','.join(PROVIDERS)}, got {bad}")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    out = []
    for provider in providers:
        for backend in ["none"] if PROVIDERS[provider] is None else backends:
            result = measure(provider, backend)
            report(result, verbose=args.verbose, sources=args.sources)
            out += rows(result)
    if args.csv:
        save(out, args.csv)
        print(table(args.csv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
