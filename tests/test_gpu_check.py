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
    assert (out / "bench" / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
