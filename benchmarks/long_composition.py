"""What grpo_mem's peak memory is made of on a long prompt: every live tensor storage at the peak, by where it was made.

One scoring forward + backward of ``benchmarks/bench_long.py`` (one group of G completions of C tokens after a prompt
of P tokens, one micro-batch), on CPU, under a tracker (:class:`ComposedTracker`, a
``grpo_mem.bench.measure.TensorMemoryTracker`` that also labels each storage): a storage made in the forward is
labelled by the pass (``prompt``: the backbone called on the prompt; ``completion``; ``head``: outside the backbone)
and the module that made it (decoder layer and its sub-module: ``self_attn``, ``mlp``, the norms; ``norm``: the final
norm; ``embed_tokens``); one made in the backward is labelled ``backward`` and the operator; a storage alive at the end
that is a parameter's gradient is labelled ``parameter gradients``. Printed: the live storages at the end of the forward
and at the peak, by label (MB = 10**6 bytes), beside the run's peak resident set above its base (the rest of the RSS
is the allocator's and the kernels' scratch, which no tensor holds).

    python benchmarks/long_composition.py                      # qwen3-4b (CPU cut), P=4096, C=64, G=8, grpo_mem
    python benchmarks/long_composition.py --provider full_seq  # the same for the stock baseline (slow)
    python benchmarks/long_composition.py --model qwen2 --layers 4   # the issue's Qwen2 shape (hidden 512, 4 layers)
    python benchmarks/long_composition.py --whole-last-layer   # the last layer over every prompt token, as before
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(1, _HERE)

from grpo_mem.bench.measure import PeakRSS, TensorMemoryTracker, release_free_memory  # noqa: E402
from grpo_mem.model import last_layer  # noqa: E402

MB = 1e6


class ComposedTracker(TensorMemoryTracker):
    """:class:`TensorMemoryTracker` that labels every storage with ``label()`` (called when the storage is made) and
    keeps the live storages' (bytes, label) at the peak (``at_peak``) and at each :meth:`snapshot`."""

    def __init__(self, label):
        super().__init__()
        self.label = label
        self.labels: dict[int, str] = {}
        self.at_peak: dict[int, tuple[int, str]] = {}
        self._peak_seen = 0

    def _account(self, t, input_keys):
        before = self.live_bytes
        super()._account(t, input_keys)
        if self.live_bytes != before:
            key = t.untyped_storage().data_ptr()
            self.labels[key] = self.label()
            if self.live_bytes > self._peak_seen * 1.0005:  # a new peak (not re-copied for every byte)
                self._peak_seen = self.live_bytes
                self.at_peak = self.snapshot()

    def snapshot(self) -> dict[int, tuple[int, str]]:
        return {k: (n, self.labels.get(k, "?")) for k, n in self._sizes.items()}


def by_label(snapshot: dict[int, tuple[int, str]], relabel: dict[int, str]) -> dict[str, float]:
    """MB by label of a snapshot, largest first; a storage made in the backward takes its label from ``relabel``
    (storage -> label) where it has one (a freed forward storage's address may be a gradient's later)."""
    out: dict[str, float] = defaultdict(float)
    for key, (n, label) in snapshot.items():
        out[relabel.get(key, label) if label == "backward" else label] += n / MB
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def coarse(fine: dict[str, float], layers: int) -> dict[str, float]:
    """``fine`` (MB by label) summed into terms: the prompt pass's layers below the last, its last layer, its final
    norm, its embeddings and RoPE tables; the completion pass; the head; the backward; the parameter gradients."""
    out: dict[str, float] = defaultdict(float)
    for label, mb in fine.items():
        pass_, _, where = label.partition(": ")
        if pass_ == "prompt" and where.split(".")[0].split(" ")[0].isdigit():
            last = int(where.split(".")[0].split(" ")[0]) == layers - 1
            term = f"prompt pass: layer {layers - 1} (the last)" if last else f"prompt pass: layers 0-{layers - 2}"
            if last and "." in where:
                term += f", {where.split('.', 1)[1]}"
        elif pass_ == "prompt":
            term = "prompt pass: final norm" if where == "norm" else "prompt pass: embeddings, RoPE"
        elif pass_ == "full-sequence":
            term = f"full-sequence pass: {where.split('.', 1)[-1] if where[:1].isdigit() else where}"
        elif pass_ == "completion":
            term = "completion pass"
        else:
            term = label
        out[term] += mb
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def labeller(model, C: int, wide: str = "prompt"):
    """(label function, hooks, state): the label names the backbone pass (by its width: wider than C is a prompt
    pass, named ``wide``; the completion pass runs C - 1 tokens a row) and the module
    running (the innermost module under a decoder layer, or the backbone's own child; the last decoder layer as a
    whole), else ``head``."""
    state = {"pass": None, "stack": [], "backward": False}
    backbone = model.get_decoder()
    hooks = []

    def enter(name):
        def pre(module, args, kwargs):
            if module is backbone:
                ids = kwargs.get("input_ids", args[0] if args else None)
                state["pass"] = wide if ids is not None and ids.shape[1] > C else "completion"
            state["stack"].append(name)

        return pre

    def leave(module, args, kwargs, out):
        state["stack"].pop()
        if module is backbone:
            state["pass"] = None

    stack = last_layer.decoder_stack(
        backbone
    )  # the last layer's modules stay unhooked: hooks keep it whole (``last_layer``)
    inside = {id(m) for m in stack[-1].modules() if m is not stack[-1]} if stack is not None else set()
    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        hooks.append(module.register_forward_pre_hook(enter(name), with_kwargs=True))
        hooks.append(module.register_forward_hook(leave, with_kwargs=True))

    def label() -> str:
        if state["backward"]:
            return "backward"
        if state["pass"] is None:
            return "head (outside the backbone)"
        parts = [p for p in (state["stack"][-1] if state["stack"] else "").split(".") if p]
        if "layers" in parts:
            i = parts.index("layers")
            where = ".".join(parts[i + 1 : i + 3]) if len(parts) > i + 2 else f"{parts[i + 1]} (layer)"
        else:
            where = parts[-1] if parts else "backbone"
        return f"{state['pass']}: {where}"

    return label, hooks, state


def model_config(args) -> dict:
    """The config of ``args.model`` (a bench_long model at its CPU cut, or a ``BENCH_MODELS`` name), at ``args.layers``
    layers when given."""
    import bench_long

    from grpo_mem.bench.presets import bench_model_config

    if args.model in bench_long.MODELS:
        config = bench_long.model_config(args.model, cpu_cut=True)
    else:
        config = bench_model_config(args.model)
        config["max_position_embeddings"] = args.P + args.C
    if args.layers:
        config["num_hidden_layers"] = args.layers
        if "layer_types" in config:
            config["layer_types"] = config["layer_types"][: args.layers]
    return config


def report(args, model, config, rss, tracker, forward_end) -> None:
    """Print the run's peaks and the live storages by label at the end of the forward and at the peak."""
    grads = {
        p.grad.untyped_storage().data_ptr(): "parameter gradients" for p in model.parameters() if p.grad is not None
    }
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"{args.provider}, {args.model} ({n_params / 1e6:.1f}M parameters, {config['num_hidden_layers']} layers, "
        f"hidden {config['hidden_size']}), P={args.P}, C={args.C}, G={args.G}: peak RSS above base "
        f"{rss.peak_above_base / MB:.0f} MB, peak of live tensors {tracker.peak_bytes / MB:.0f} MB (MB = 1e6 bytes)"
    )
    layers = config["num_hidden_layers"]
    for title, snap in (("end of forward", forward_end), ("peak", tracker.at_peak)):
        fine = by_label(snap, grads)
        print(f"\n{title}: {sum(fine.values()):.0f} MB live")
        for k, v in (fine if args.by_layer else coarse(fine, layers)).items():
            if v >= 0.05:
                print(f"  {v:9.1f}  {k}")
    kv = 2 * config["num_key_value_heads"] * config.get("head_dim", 64) * 4 * layers
    print(f"\nrecorded prompt K/V (inside the prompt pass's self_attn terms): {kv / MB:.4f} MB per prompt token")


def main(argv=None) -> int:
    from grpo_mem.bench.group import build_model, make_inputs, make_logprob_fn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-4b", help="a bench_long model (CPU cut) or a BENCH_MODELS name")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--provider", default="grpo_mem", choices=("grpo_mem", "full_seq"))
    ap.add_argument("-P", type=int, default=4096)
    ap.add_argument("-C", type=int, default=64)
    ap.add_argument("-G", type=int, default=8)
    ap.add_argument("--by-layer", action="store_true", help="keep the layer index in the labels")
    ap.add_argument("--whole-last-layer", action="store_true", help="run the last layer over every prompt token")
    args = ap.parse_args(argv)
    if args.whole_last_layer:  # as before model/last_layer.py: no call cuts its last layer
        last_layer.Cut.of = classmethod(lambda *a, **k: None)
    config = model_config(args)
    model = build_model(config)
    ids, mask, cmask = make_inputs(args.G, args.P, args.C, 1, config["vocab_size"], seed=1)
    fn = make_logprob_fn(args.provider, model, args.C)
    lp, _ = fn(ids[:2, : args.P // 8 + 16 + args.C], mask[:2, : args.P // 8 + 16 + args.C])  # warm-up
    lp.sum().backward()
    model.zero_grad(set_to_none=True)
    label, hooks, state = labeller(model, args.C, "prompt" if args.provider == "grpo_mem" else "full-sequence")
    release_free_memory()
    with PeakRSS() as rss, ComposedTracker(label) as tracker:
        lp, ent = fn(ids, mask)
        loss = (lp * cmask.float()).sum()
        forward_end = tracker.snapshot()
        state["backward"] = True
        loss.backward()
    for h in hooks:
        h.remove()
    report(args, model, config, rss, tracker, forward_end)
    return 0


if __name__ == "__main__":
    sys.exit(main())
