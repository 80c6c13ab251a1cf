"""``benchmarks/gpu_check.py --device cpu --tiny``: the one-shot GPU check runs end to end in CPU mode and writes every
result file of its compact set, with real content, so it cannot rot between GPU runs."""

import csv
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from helpers import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import gpu_check


@pytest.mark.slow
def test_gpu_check_tiny_cpu(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "gpu_check.py"), "--device", "cpu", "--tiny"]
        + ["--out", str(out), "--budget-s", "900"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    log = (out / "run.log").read_text() if (out / "run.log").exists() else proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log[-6000:]

    # exactly the check's result set: at most 8 files, none deeper than one folder
    written = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert written == sorted(gpu_check.RESULT_FILES), written
    assert len(written) <= 8 and all(name.count("/") <= 1 for name in written)

    last = log.strip().splitlines()[-1]
    assert last.startswith("gpu_check summary") and all(f"{p} ok " in last for p in gpu_check.PHASES), last

    env = (out / "env.txt").read_text()
    assert "torch " in env and "transformers " in env and "trl " in env

    suite = ET.parse(out / "kernels.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert int(suite.get("tests")) >= 3 and int(suite.get("failures")) == 0 and int(suite.get("errors")) == 0
    assert int(suite.get("skipped")) == 0
    with open(out / "kernels.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["kind"] == "error"]
    cases = {r["case"].split("/")[0] for r in rows}
    assert cases == {"attention", "linear_logprobs", "selective_log_softmax"}, cases
    assert all(r["ok"] == "True" and float(r["max_abs_err"]) <= float(r["bound"]) for r in rows)

    verify = (out / "verify.txt").read_text()
    assert verify.count("grpo_mem.verify: PASSED") == 2 and verify.strip().endswith(
        "verify: PASSED (both runs passed, every micro-batch prompt-once)"
    )

    train = json.loads((out / "train.json").read_text())
    assert train["passed"] and set(train["runs"]) == {"fp32", "bf16"}
    fp32 = train["runs"]["fp32"]
    assert len(fp32["stock"]["steps"]) == len(fp32["patched"]["steps"]) == train["settings"]["steps"]
    assert fp32["compare"]["all_steps_same_batch"]
    for step in fp32["compare"]["steps"]:
        assert abs(step["loss_patched"] - step["loss_stock"]) <= 1e-6 and step["max_grad_rel_diff"] <= 1e-4
    assert fp32["compare"]["final_weight_max_abs_diff"] <= 1e-5

    with open(out / "bench" / "bench.csv", newline="") as f:
        bench = list(csv.DictReader(f))
    models = {json.loads(r["config"])["model"] for r in bench}
    providers = {r["provider"] for r in bench}
    assert models == {"qwen3-tiny", "qwen3.5-tiny"} and {"trl", "grpo_mem"} <= providers
    assert not any("skipped" in json.loads(r["config"]) for r in bench)

    check_perf_csv(out / "perf.csv")
    assert "| provider | wall s | x stock |" in log  # the perf phase's summary


def check_perf_csv(path):
    """perf.csv: the long-format columns; for both tiny shapes, stock TRL and every grpo_mem backend pair the CPU
    offers, every metric measured (none skipped), launches and wall time positive, the backends that ran named."""
    import torch

    from grpo_mem.bench.results import CSV_COLUMNS

    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert tuple(reader.fieldnames) == CSV_COLUMNS
    providers = [p for p, _ in gpu_check.perf_providers("cpu", torch.float32)]
    assert providers[0] == "trl" and "grpo_mem[torch]" in providers and len(providers) >= 2
    shapes = [str(s["P"]) for s in gpu_check.settings(True)["perf"]["shapes"]]
    metrics = {m for m, _ in gpu_check.PERF_METRICS}
    cells = {}
    for r in rows:
        cells.setdefault((r["x_value"], r["provider"]), {})[r["metric"]] = r
    assert set(cells) == {(P, p) for P in shapes for p in providers}, sorted(cells)
    for (P, provider), by_metric in cells.items():
        assert set(by_metric) == metrics, (P, provider, metrics ^ set(by_metric))
        config = json.loads(by_metric["wall_time"]["config"])
        assert "skipped" not in config and r["op"] == "perf" and r["mode"] == "full"
        assert float(by_metric["launches"]["p50"]) > 0 and float(by_metric["wall_time"]["p50"]) > 0
        assert float(by_metric["host_syncs"]["p50"]) >= 0 and 0 <= float(by_metric["gpu_idle_share"]["p50"]) <= 1
        assert float(by_metric["busy_time"]["p50"]) > 0
        if provider != "trl":
            assert config["multi_region_attention"] != "-" and config["linear_logprobs"] != "-", config


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--phases", "env,gpu"], "--phases must be a comma-separated subset"),
        (["--budget-s", "0"], "--budget-s must be > 0"),
        (["--backend", "cuda"], "invalid choice: 'cuda'"),
    ],
)
def test_bad_flags_name_themselves(argv, match, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse(["--out", "x"] + argv)
    assert exc.value.code == 2 and match in capsys.readouterr().err


def test_backend_flag_reaches_every_phase(tmp_path):
    """``--backend torch`` puts GRPO_MEM_BACKEND=torch into each phase's environment; caches go under the work
    directory, never under --out."""
    args = gpu_check.parse(["--out", str(tmp_path / "out"), "--backend", "torch", "--device", "cpu"])
    env = gpu_check.phase_env(args, str(tmp_path / "work"))
    assert env["GRPO_MEM_BACKEND"] == "torch" and env["HF_HUB_OFFLINE"] == "1"
    assert env["TRITON_CACHE_DIR"].startswith(str(tmp_path / "work"))
    cmd = gpu_check.phase_command(args, "kernels", str(tmp_path / "work"))
    assert "no:cacheprovider" in cmd and f"--junitxml={tmp_path / 'out' / 'kernels.xml'}" in cmd


def test_perf_first_after_env_and_the_default_budget_gives_every_phase_its_limit():
    assert gpu_check.PHASES[:2] == ("env", "perf")
    assert set(gpu_check.LIMITS) == set(gpu_check.TINY_LIMITS) == set(gpu_check.PHASES)
    assert gpu_check.LIMITS["perf"] <= 240
    assert gpu_check.parse(["--out", "x"]).budget_s >= sum(gpu_check.LIMITS.values())
    assert "perf.csv" in gpu_check.RESULT_FILES and len(gpu_check.RESULT_FILES) <= 8


def test_kernel_categories_and_busy_time():
    """Kernel names as CUDA and the CPU profiler show them land in their category; overlapping intervals count once."""
    cases = {
        "_mra_fwd_kernel": "attention",
        "void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64>>": "attention",
        "fmha_cutlassB_bf16_aligned_64x64_k128": "attention",
        "_linear_logprobs_bwd_dlogits_kernel": "head",
        "_forward_kernel": "head",
        "nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN": "gemm",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "gemm",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "memset",
        "Memset (Device)": "memset",
        "Memcpy DtoH (Device -> Pageable)": "copies",
        "void at::native::elementwise_kernel<128, 2, direct_copy_kernel_cuda>": "copies",
        "void at::native::index_elementwise_kernel<128, 4>": "copies",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>": "elementwise",
        "void at::native::reduce_kernel<512, 1>": "elementwise",
        "aten::mm": "gemm",
        "aten::mul": "elementwise",
        "aten::sum": "elementwise",
        "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
        "grpo_mem::linear_logprobs_fwd": "head",
        "aten::arange": "other",
    }
    assert {name: gpu_check.classify_kernel(name) for name in cases} == cases
    assert gpu_check.busy_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25


class _Raw:
    """A Kineto event as ``torch.profiler`` keeps it (``prof.profiler.kineto_results.events()``)."""

    def __init__(self, name, on_device, start_us, end_us):
        from torch.autograd import DeviceType

        self._v = (name, DeviceType.CUDA if on_device else DeviceType.CPU, start_us * 1000, end_us * 1000)

    def name(self):
        return self._v[0]

    def device_type(self):
        return self._v[1]

    def start_ns(self):
        return self._v[2]

    def end_ns(self):
        return self._v[3]


def test_cuda_profile_reading_on_recorded_events():
    """The CUDA half of the perf phase's device table on events laid out as a CUDA profile lays them out: kernels,
    copies and memsets are device time, only kernels are launches, and host syncs count inside the step's range only
    (the profiler's own synchronisation when it stops is outside)."""
    import types

    raw = [
        _Raw(gpu_check.STEP_LABEL, False, 0, 1000),
        _Raw(gpu_check.STEP_LABEL, True, 10, 900),  # the range's device-side copy
        _Raw("cudaLaunchKernel", False, 20, 25),
        _Raw("_mra_fwd_kernel", True, 30, 130),
        _Raw("nvjet_hsh_gemm", True, 100, 200),
        _Raw("Memcpy DtoH (Device -> Pageable)", True, 300, 310),
        _Raw("cudaStreamSynchronize", False, 305, 320),
        _Raw("Memset (Device)", True, 400, 402),
        _Raw("cudaDeviceSynchronize", False, 1100, 1200),
    ]
    results = types.SimpleNamespace(events=lambda: raw)
    prof = types.SimpleNamespace(profiler=types.SimpleNamespace(kineto_results=results))
    cuda = gpu_check.PERF_DEVICES["cuda"]
    kernels = cuda.kernels(prof)
    assert [k[0] for k in kernels] == [e.name() for e in raw[3:] if e.device_type().name == "CUDA"]
    assert cuda.counts(prof, None) == (2, 1)
    metrics = gpu_check._kernel_metrics(kernels, wall_s=0.001)
    assert abs(metrics["busy_time"] - 0.182) < 1e-12 and abs(metrics["gpu_idle_share"] - 0.818) < 1e-9
    assert metrics["kernel_time_attention"] == metrics["kernel_time_gemm"] == 0.1
    assert metrics["kernel_time_copies"] == 0.01 and metrics["kernel_time_memset"] == 0.002


def test_perf_measure_on_cpu():
    """One provider at a toy shape through the CPU half of the device table: every metric of perf.csv, launches and
    host reads as bench_launches counts them, and the rows of a skipped provider say why."""
    import torch

    from grpo_mem.bench.group import build_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _perf_measure_on_cpu(build_model(dict(gpu_check.TINY_QWEN3, num_hidden_layers=1)))
    finally:
        torch.set_num_threads(threads)


def _perf_measure_on_cpu(model):
    shape = dict(P=16, C=4, G=2, micro=1, repeats=2)
    batches = gpu_check.perf_batches(shape, gpu_check.TINY_QWEN3["vocab_size"], "cpu")
    dev = gpu_check.PERF_DEVICES["cpu"]
    m = gpu_check.perf_measure(dev, model, batches, shape["C"], "torch", shape["repeats"])
    assert m["ran"] == {"multi_region_attention": "torch", "linear_logprobs": "torch"}
    assert len(m["wall_time"]) == 2 and m["launches"] > 0 and m["host_syncs"] > 0 and m["busy_time"] > 0
    rows = gpu_check.perf_rows("grpo_mem[torch]", shape, dict(shape), dev, m)
    assert [r["metric"] for r in rows] == [name for name, _ in gpu_check.PERF_METRICS]
    skipped = gpu_check.perf_rows("trl", shape, dict(shape), dev, None, "no time")
    assert len(skipped) == len(rows) and all(r["p50"] == "" and "no time" in r["config"] for r in skipped)
