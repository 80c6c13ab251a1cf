"""Write the generated tables of docs/ from the committed CSVs in benchmarks/results/.

    python benchmarks/docs_tables.py           # rewrite every generated block of docs/benchmarks.md,
                                               # docs/supported-models.md and docs/distributed.md
    python benchmarks/docs_tables.py --check   # exit 1, naming the blocks, if a page differs from its CSVs

Each table is the one the benchmark script prints with ``--table`` (its own ``table`` functions, called on its
default CSV); the architecture table is the sweep's CSV (``tests/model/test_architectures.py`` writes it) in the rows
that script prints. A generated block sits between ``<!-- generated: NAME -->`` and ``<!-- end generated: NAME -->``
and is replaced whole; the text around it is not touched.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import re
import sys
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
BENCHMARKS_PAGE = os.path.join(ROOT, "docs", "benchmarks.md")
MODELS_PAGE = os.path.join(ROOT, "docs", "supported-models.md")
DISTRIBUTED_PAGE = os.path.join(ROOT, "docs", "distributed.md")


def _script(name: str):
    """The benchmark script ``benchmarks/<name>.py`` as a module (its ``main`` is not run)."""
    spec = importlib.util.spec_from_file_location(f"_docs_{name}", os.path.join(HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def architecture_table(path: str = os.path.join(RESULTS, "architectures.csv")) -> str:
    """The support table of every causal LM type, as ``python tests/model/test_architectures.py`` prints it."""
    lines = ["| model type | class | path | cause |", "|---|---|---|---|"]
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            cause = r["cause"].replace("|", "/")
            lines.append(f"| `{r['model_type']}` | {r['model_class']} | {r['status']} | {cause} |")
    return "\n".join(lines)


def architecture_counts(path: str = os.path.join(RESULTS, "architectures.csv")) -> str:
    """One line: how many types take each path."""
    with open(path, newline="") as f:
        status = [r["status"] for r in csv.DictReader(f)]
    parts = [f"{status.count(s)} {s}" for s in ("prompt-once", "fallback", "not built")]
    return f"{len(status)} types: " + ", ".join(parts) + "."


def blocks() -> dict[str, dict[str, Callable[[], str]]]:
    """Page -> {block name: function returning the block's text}."""
    group, tree, vlm = _script("bench_group"), _script("bench_tree"), _script("bench_vlm")
    attention, head, fsdp = _script("bench_attention"), _script("bench_head"), _script("bench_fsdp")
    sp, longest, long = _script("bench_sp"), _script("longest_prompt"), _script("bench_long")
    launches = _script("bench_launches")
    return {
        BENCHMARKS_PAGE: {
            "group": lambda: group.table(),
            "group-targets": lambda: group.targets(),
            "group-split": lambda: group.split_summary(),
            "tree": lambda: tree.table(),
            "tree-threshold": lambda: tree.threshold_table(),
            "vlm": lambda: vlm.table(),
            "attention": lambda: attention.table(attention.CSV_PATH),
            "head": lambda: head.table(),
            "fsdp": lambda: fsdp.table(),
            "fsdp-tree": lambda: fsdp.window_table(),
            "sp": lambda: sp.table(),
            "long": lambda: long.table(),
            "launches": lambda: launches.table(),
        },
        DISTRIBUTED_PAGE: {"sp-estimate": lambda: longest.table(longest.rows())},
        MODELS_PAGE: {"architectures": architecture_table, "architecture-counts": architecture_counts},
    }


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with the block ``name`` holding ``body``. Raises ValueError if the page has no such block."""
    pattern = re.compile(
        rf"(<!-- generated: {re.escape(name)} -->\n)(.*?)(<!-- end generated: {re.escape(name)} -->)", re.DOTALL
    )
    if not pattern.search(text):
        raise ValueError(f"no generated block {name!r} (<!-- generated: {name} --> ... <!-- end generated: {name} -->)")
    return pattern.sub(lambda m: m.group(1) + body.rstrip("\n") + "\n" + m.group(3), text, count=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 if a page is out of date")
    args = ap.parse_args(argv)
    stale = []
    for page, makers in blocks().items():
        with open(page) as f:
            old = f.read()
        new = old
        for name, make in makers.items():
            new = replace_block(new, name, make())
            if replace_block(old, name, make()) != old:
                stale.append(f"{os.path.relpath(page, ROOT)}: {name}")
        if not args.check and new != old:
            with open(page, "w") as f:
                f.write(new)
            print(f"wrote {os.path.relpath(page, ROOT)}")
    if args.check and stale:
        print("out of date with benchmarks/results/: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
