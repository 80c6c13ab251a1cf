"""The launch and host-read counts (``grpo_mem.bench.launches``) count what they say, and ``benchmarks/bench_launches.py``
runs end to end on a tiny shape (seconds)."""

import json
import os
import sys

import pytest
import torch
from helpers import REPO

from grpo_mem.bench import launches, results

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import bench_launches  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    """Counts do not depend on threads; one thread keeps the tiny runs fast on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _line(tag: str) -> int:
    """The line of this file holding the comment ``# <tag>``."""
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if text.rstrip().endswith(f"# {tag}"))


def test_matmul_relu_forward_backward_counts_its_kernels_and_no_views():
    """relu(x @ w) and its backward: mm, relu, threshold_backward, then the two gradient GEMMs; the transposes and
    AccumulateGrad's detach are views, left out; nothing is read by the host."""
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 5, requires_grad=True)
    seed = torch.ones(4, 5)

    def call():
        torch.autograd.backward(torch.relu(x @ w), seed)

    counts = launches.count_call(call)
    assert dict(counts.launches) == {"mm": 3, "relu": 1, "threshold_backward": 1}
    assert counts.total_launches == 5 and counts.views > 0 and counts.reads == []
    # a second backward accumulates into the existing gradients: one add_ each
    again = launches.count_call(call)
    assert again.launches["add_"] == 2 and again.total_launches == 7


def test_each_host_read_counts_once_at_its_line():
    t = torch.tensor([1, 0, 2])

    def call():
        t.tolist()  # tolist
        bool(t[0])  # bool
        t.nonzero()  # nonzero
        t.numpy()  # numpy
        t[1].item()  # item
        t[t > 0]  # mask
        t[torch.tensor([0, 2])]  # no read: integer indices

    counts = launches.count_call(call)
    here = os.path.basename(__file__)
    expected = [
        ("Tensor.tolist", "tolist"),
        ("_local_scalar_dense", "bool"),
        ("nonzero", "nonzero"),
        ("Tensor.numpy", "numpy"),
        ("Tensor.item", "item"),
        ("index (bool mask)", "mask"),
    ]
    assert [(what, where) for what, where, _ in counts.reads] == [
        (what, f"{here}:{_line(tag)} (call)") for what, tag in expected
    ]
    assert counts.host_reads() == counts.host_reads(outside_cpu_kernels=True) == 6
    assert counts.launches["nonzero"] == 1  # a read and a kernel
    # the Tensor methods are restored
    assert "tolist" not in torch.Tensor.__dict__ and "item" not in torch.Tensor.__dict__


def test_reads_under_a_cpu_only_kernel_are_marked(monkeypatch):
    """A read whose outermost backend module is a CPU-only one (the C++ head's launcher) is counted apart; the
    torch backend's own reads are not."""
    assert launches.backend_files()["grpo_mem/ops/logprobs_cpp.py"] is True
    assert launches.backend_files()["grpo_mem/ops/attention_torch.py"] is False
    from grpo_mem.ops import logprobs_cpp

    code = compile("def probe(t):\n    return t.tolist()\n", logprobs_cpp.__file__, "exec")
    scope = {}
    exec(code, scope)
    counts = launches.count_call(lambda: scope["probe"](torch.zeros(2)))
    assert counts.host_reads() == 1 and counts.host_reads(outside_cpu_kernels=True) == 0
    ((what, where, in_kernel),) = counts.reads
    assert where == "grpo_mem/ops/logprobs_cpp.py:2 (probe)" and in_kernel


def test_bench_launches_on_a_tiny_shape(tmp_path):
    """Stock TRL and grpo_mem's tree sharing under the torch backend on a 2-prompt, P=16 batch: every metric present
    and positive where it must be, grpo_mem launching more per layer than stock today; the CSV keeps one row per
    metric and its table names both."""
    shape = dict(prompts=2, G=2, P=16, C=4)
    spec = dict(bench_launches.MODEL, hidden_size=16, intermediate_size=32, vocab_size=64)
    stock = bench_launches.measure("trl", "none", shape, spec)
    ours = bench_launches.measure("grpo_mem_tree", "torch", shape, spec)
    for r in (stock, ours):
        assert r["launches_per_layer"] > 0 and r["launches_per_call"] > 2 * r["launches_per_layer"]
        assert 0 <= r["host_reads_outside_cpu_kernels"] <= r["host_reads_per_call"]
    assert ours["launches_per_layer"] > stock["launches_per_layer"]
    path = str(tmp_path / "launches.csv")
    bench_launches.save(bench_launches.rows(stock, shape, spec) + bench_launches.rows(ours, shape, spec), path)
    bench_launches.save(bench_launches.rows(ours, shape, spec), path)  # replaces its own rows only
    rows = results.read_csv(path)
    assert len(rows) == 8 and {r["metric"] for r in rows} == {m for m, _ in bench_launches.METRICS}
    assert {(r["provider"], r["config"]["backend"]) for r in rows} == {("trl", "none"), ("grpo_mem_tree", "torch")}
    assert all(r["p50"] == r["p20"] == r["p80"] for r in rows)
    per_layer = next(r for r in rows if r["metric"] == "launches_per_layer")
    assert per_layer["config"]["layers"] == [2, 4] and json.dumps(per_layer["config"])
    text = bench_launches.table(path)
    assert "| trl | none |" in text and "| grpo_mem_tree | torch |" in text


@pytest.mark.parametrize("provider", ["trl", "grpo_mem_group"])
def test_scoring_step_backpropagates(provider):
    """Each provider's step fills every parameter's gradient."""
    from grpo_mem.bench.group import build_model, make_inputs

    spec = dict(bench_launches.MODEL, hidden_size=16, intermediate_size=32, vocab_size=64, num_hidden_layers=1)
    model = build_model(spec)
    ids, mask, _ = make_inputs(2, 8, 4, 2, 64)
    launches.scoring_step(provider, model, [(ids[:2], mask[:2]), (ids[2:], mask[2:])], 4)()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
