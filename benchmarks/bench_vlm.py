"""One image-prompt group through a Qwen2.5-VL-shaped model: stock TRL 1.16 vs grpo_mem.

The configuration: one prompt of 1 image + 64 text tokens (``<|vision_start|>`` and ``<|vision_end|>`` among them),
G = 8 completions of C = 64 tokens each (all real, no padding). The image is a 64 x 64 grid of 14 x 14 patches
(``image_grid_thw`` (1, 64, 64), temporal patch 2, so 4096 patch rows of 3·2·14·14 = 1176 floats); the vision tower's
2 x 2 merge turns it into 1024 image tokens, so the prompt is P = 1088 tokens. The model: Qwen2.5-VL with the
``llama`` benchmark trunk as its language model (8 layers, hidden 512, intermediate 1408, 8 query / 2 KV heads of 64,
V = 8192; ``grpo_mem.bench.presets.BENCH_MODELS``) and a 4-layer vision tower (hidden 512, intermediate 1368, 8 heads,
patch 14, window 112 with full attention in its last layer, out_hidden_size 512); random weights, fp32, SDPA, train
mode.

The op, per provider: the per-token log-probs (and entropies) of every completion token through a trainer-like
object's ``_get_per_token_logps_and_entropies`` (the batch in one chunk, temperature 1), then
``log_probs.sum().backward()`` into freshly ``None``-ed parameter gradients.

- ``trl``: TRL's own method, ``GRPOTrainer._get_per_token_logps_and_entropies``, on the model given TRL's fused head
  (``add_fused_lm_head``): every row sends its copy of the image through the vision tower and its 1152 tokens through
  the language model.
- ``grpo_mem``: the same method patched (``grpo_mem.bench.vision.scoring_method``, group sharing): the image
  once through the vision tower, the prompt once through the language model, the completions attending to its K/V.

Ideal ratio (tokens through vision tower + language model, grpo_mem over stock, with Nv = 4096 patch rows per image,
P = 1088, C = 64, G = 8)::

    rho = (Nv + P + G·(C - 1)) / (G·Nv + G·(P + C)) = (4096 + 1088 + 504) / (32768 + 9216) = 5688 / 41984 ≈ 0.1355

(grpo_mem forwards each completion's first C - 1 tokens after the prompt; the last token is only a target.) Each
provider runs once in a fresh process (``harness.run_isolated``, 1 thread): one call timed (wall and CPU time) and
memory-measured at once (``harness.measure_once``: peak RSS above the base just before the call; weights and inputs
are in the base) after no warm-up call. The providers' log-probs are compared (max |diff| printed and stored).

Usage (from the repository root)::

    python benchmarks/bench_vlm.py           # -> benchmarks/results/vlm.csv and a markdown row
    python benchmarks/bench_vlm.py --table   # reprint the row from the CSV
"""

from __future__ import annotations

import argparse
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))  # the checkout's grpo_mem: the script measures the code beside it

from grpo_mem.bench import harness, tokens  # noqa: E402
from grpo_mem.bench.presets import BENCH_MODELS  # noqa: E402

OP = "vlm_group_logprobs"
PROVIDERS = ("trl", "grpo_mem")
RESULTS = os.path.join(_HERE, "results")
CSV_PATH = os.path.join(RESULTS, "vlm.csv")
SHAPE = dict(G=8, C=64, grid=(1, 64, 64), text_before=31, text_after=31)
"""31 + <|vision_start|> + 1024 image tokens + <|vision_end|> + 31: 64 text tokens, P = 1088."""
IMAGE, VIDEO, VISION_START, VISION_END = 8190, 8191, 8188, 8189
MERGE, PATCH, TEMPORAL, CHANNELS = 2, 14, 2, 3
VISION = dict(
    depth=4,
    hidden_size=512,
    intermediate_size=1368,
    num_heads=8,
    out_hidden_size=512,
    patch_size=PATCH,
    spatial_merge_size=MERGE,
    temporal_patch_size=TEMPORAL,
    in_channels=CHANNELS,
    window_size=112,
    fullatt_block_indexes=[3],
)


def token_counts(G: int, C: int, grid: tuple[int, int, int], text: int) -> dict:
    """Tokens through the vision tower (patch rows) and the language model, per provider, and their ratio rho
    (``grpo_mem.bench.tokens.token_counts`` of one prompt of the grid's image and ``text`` text tokens)."""
    patches = grid[0] * grid[1] * grid[2]
    P = patches // MERGE**2 + text
    c = tokens.token_counts(G, P, C, image_tokens=patches // MERGE**2, rows_per_token=MERGE**2)
    gm, stock = c["grpo_mem_vision"] + c["grpo_mem_lm"], c["trl_vision"] + c["trl_lm"]
    return dict(P=P, patches=patches, grpo_mem_tokens=gm, trl_tokens=stock, ideal_ratio=c["ideal_ratio"])


def build_model(seed: int = 0):
    """The Qwen2.5-VL of the module docstring, random weights, fp32, SDPA, train mode."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    llama = BENCH_MODELS["llama"]
    text = {
        k: llama[k]
        for k in (
            "num_hidden_layers",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
        )
    }  # heads of 512 / 8 = 64
    text.update(
        max_position_embeddings=4096,
        attention_dropout=0.0,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]},
    )
    config = AutoConfig.for_model(
        "qwen2_5_vl",
        text_config=text,
        vision_config=dict(VISION),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=1,
    )
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").float().train()


def make_batch(G: int, C: int, grid: tuple[int, int, int], text_before: int, text_after: int, seed: int = 1):
    """One prompt (random text, the image's tokens, random text) repeated G times with G random full-length
    completions, laid out as Qwen's processor and TRL lay them out. Returns ``(input_ids (G, P + C) int64,
    attention_mask (G, P + C) int64 all ones, extras)``: TRL's multimodal keyword arguments, ``pixel_values``
    (G·patches, 1176) fp32 (the image repeated per row), ``image_grid_thw`` (G, 3), ``num_images``,
    ``mm_token_type_ids`` (G, P + C)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    t, h, w = grid
    n_image = t * h * w // MERGE**2
    prompt = torch.cat(
        [
            torch.randint(3, 8000, (text_before,), generator=g),
            torch.tensor([VISION_START]),
            torch.full((n_image,), IMAGE),
            torch.tensor([VISION_END]),
            torch.randint(3, 8000, (text_after,), generator=g),
        ]
    )
    image = torch.randn(t * h * w, CHANNELS * TEMPORAL * PATCH * PATCH, generator=g)
    ids = torch.cat([prompt.expand(G, -1), torch.randint(3, 8000, (G, C), generator=g)], 1)
    mm = (ids == IMAGE).long()
    extras = dict(
        pixel_values=image.repeat(G, 1),
        image_grid_thw=torch.tensor([grid] * G),
        num_images=[1] * G,
        mm_token_type_ids=mm,
    )
    return ids, torch.ones_like(ids), extras


def worker(args: dict) -> dict:
    """One provider in a fresh process (target of ``harness.run_isolated``): build, measure once, return the
    measurement dict plus ``log_probs`` (G, C) as lists, ``grad_norm``, ``vision_patch_rows`` (patch rows the vision
    tower encoded in the measured call), ``fallbacks`` (grpo_mem's recorded fallbacks) and ``version``."""
    from trl.trainer.utils import add_fused_lm_head

    from grpo_mem.bench.group_worker import grad_norm
    from grpo_mem.bench.vision import scoring_method
    from grpo_mem.model.fallback import recording_fallbacks

    if args["provider"] not in PROVIDERS:
        raise ValueError(f"provider must be one of {PROVIDERS}, got {args['provider']!r}")
    method, trainer, _ = scoring_method(args["provider"])
    model = build_model()
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    ids, mask, extras = make_batch(SHAPE["G"], SHAPE["C"], SHAPE["grid"], SHAPE["text_before"], SHAPE["text_after"])
    last, encoded = {}, []
    model.model.visual.register_forward_hook(
        lambda mod, a, kw, out: encoded.append(int(kw["grid_thw"].prod(-1).sum())), with_kwargs=True
    )

    def op():
        encoded.clear()
        lp, _, _ = method(trainer, model, ids, mask, SHAPE["C"], batch_size=SHAPE["G"], compute_entropy=True, **extras)
        lp.sum().backward()
        last["lp"] = lp.detach()

    with recording_fallbacks() as fallbacks:
        m = harness.measure_once(op, setup=lambda: model.zero_grad(set_to_none=True))
    return dict(
        m.to_dict(),
        vision_patch_rows=sum(encoded),
        fallbacks=[str(f) for f in fallbacks],
        log_probs=last["lp"].tolist(),
        grad_norm=grad_norm(model),
        n_params=sum(p.numel() for p in model.parameters()),
        version=harness.versions(),
    )


# --------------------------------------------------------------------------------------------------- parent side
def run(threads: int, timeout_s: float, rss_budget_mb: float) -> str:
    """Both providers, each in a fresh process; writes :data:`CSV_PATH` and returns the markdown row."""
    counts = token_counts(SHAPE["G"], SHAPE["C"], SHAPE["grid"], SHAPE["text_before"] + SHAPE["text_after"] + 2)
    config = dict(
        model="qwen2.5-vl",
        G=SHAPE["G"],
        C=SHAPE["C"],
        image_grid_thw=list(SHAPE["grid"]),
        vision=VISION,
        threads=threads,
        **counts,
    )
    results = {}
    for prov in PROVIDERS:
        results[prov] = harness.run_isolated(
            f"{os.path.abspath(__file__)}:worker",
            {"provider": prov},
            threads=threads,
            timeout_s=timeout_s,
            rss_budget_mb=rss_budget_mb,
        )
        if "skipped" in results[prov]:
            print(f"{prov}: skipped: {results[prov]['skipped']}\n{results[prov].get('stderr_tail', '')}")
    rows = []
    ok = all("skipped" not in r for r in results.values())
    diff = None
    if ok:
        import torch

        diff = float(
            (torch.tensor(results["grpo_mem"]["log_probs"]) - torch.tensor(results["trl"]["log_probs"])).abs().max()
        )
        print(
            f"log-probs grpo_mem vs trl: max |diff| = {diff:.2e}; grad norms "
            f"{results['grpo_mem']['grad_norm']:.6g} vs {results['trl']['grad_norm']:.6g}"
        )
    for prov, r in results.items():
        if "skipped" in r:
            rows += harness.skipped_rows(OP, prov, "full", "P", counts["P"], config, r["skipped"])
            continue
        cfg = dict(
            config,
            grad_norm=r["grad_norm"],
            n_params=r["n_params"],
            logp_max_abs_diff_vs_trl=diff,
            vision_patch_rows=r["vision_patch_rows"],
            fallbacks=r["fallbacks"],
        )
        print(f"{prov}: vision tower encoded {r['vision_patch_rows']} patch rows; fallbacks {r['fallbacks']}")
        rows += harness.measurement_rows(OP, prov, "full", "P", counts["P"], r, cfg, version=r["version"])
    harness.write_csv(rows, CSV_PATH)
    return table()


def table(path: str = CSV_PATH) -> str:
    """The markdown row of the CSV: each provider's p50 wall time, CPU time and peak RSS above base, grpo_mem over
    trl for each, the ideal ratio and each ratio over it ("x ideal"; targets time <= 1.2, memory <= 1.3)."""
    got, cfg = {}, {}
    for r in harness.read_csv(path):
        if r["op"] == OP:
            got[(r["provider"], r["metric"])] = r["p50"]
            cfg = r["config"]
    rho = cfg["ideal_ratio"]
    cells = [cfg["G"], cfg["P"], cfg["C"], rho]
    for metric in ("wall_time", "cpu_time", "peak_rss_above_base"):
        a, b = got.get(("grpo_mem", metric)), got.get(("trl", metric))
        ratio = a / b if isinstance(a, float) and isinstance(b, float) and b else None
        cells += [b, a, ratio, ratio / rho if ratio is not None else None]
    diff = cfg.get("logp_max_abs_diff_vs_trl")
    cells.append(f"{diff:.1e}" if isinstance(diff, float) else "-")
    headers = ["G", "P", "C", "ideal ρ"]
    for name, unit in (("time", "s"), ("cpu", "s"), ("mem", "MB")):
        headers += [f"{name} trl {unit}", f"{name} grpo_mem {unit}", f"{name} gm/trl", f"{name} x ideal"]
    return harness.markdown_table(headers + ["max |Δlogp|"], [cells])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table", action="store_true", help="only print the row from the CSV")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--rss-budget-mb", type=float, default=20000.0)
    a = p.parse_args(argv)
    print(table() if a.table else run(a.threads, a.timeout_s, a.rss_budget_mb))
    return 0


if __name__ == "__main__":
    sys.exit(main())
