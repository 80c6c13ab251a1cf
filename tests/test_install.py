"""Licence and install: setup.py asks for the tested ranges' lower bounds only (pip never replaces a user's
transformers or TRL), CI and constraints.txt pin releases inside them, the docs state them, and a release outside
them warns once and is served as ``grpo_mem.versions`` says: transformers only through the run-time confirmation,
TRL only through the patch's signature checks (faked versions)."""

from __future__ import annotations

import os
import re
import warnings

import pytest
from helpers import REPO, assert_close, make_batch, stock_logps, tiny_model

from grpo_mem import versions
from grpo_mem.model import confirm


def _read(rel: str) -> str:
    with open(os.path.join(REPO, rel)) as f:
        return f.read()


def _distribution():
    """setup.py's ``setup()`` arguments, read without building anything."""
    import setuptools

    captured = {}
    real = setuptools.setup
    setuptools.setup = lambda **kwargs: captured.update(kwargs)
    cwd = os.getcwd()
    try:
        os.chdir(REPO)
        code = compile(_read("setup.py"), os.path.join(REPO, "setup.py"), "exec")
        exec(code, {"__file__": os.path.join(REPO, "setup.py"), "__name__": "__main__"})
    finally:
        os.chdir(cwd)
        setuptools.setup = real
    assert isinstance(captured.get("install_requires"), list), sorted(captured)
    return captured


def test_licence_is_apache_2_in_the_file_and_the_metadata():
    text = _read("LICENSE")
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) == 202  # the whole text, as apache.org
    kwargs = _distribution()
    assert kwargs["license"] == "Apache-2.0" and kwargs["license_files"] == ["LICENSE"]


def test_measured_op_times_ship_with_the_package():
    """The table of measured per-op times that ``auto`` reads on CUDA is package data (an installed wheel has it)."""
    from grpo_mem.ops import _op_times

    assert _distribution()["package_data"] == {"grpo_mem.ops": ["op_times.csv"]}
    assert os.path.dirname(_op_times.TABLE_PATH) == os.path.join(REPO, "grpo_mem", "ops")
    assert os.path.exists(_op_times.TABLE_PATH)


def test_requirements_have_the_tested_lower_bounds_and_no_upper_bound():
    kwargs = _distribution()
    requires = {re.split(r"[<>=;! ]", r, maxsplit=1)[0]: r for r in kwargs["install_requires"]}
    for package, spec in versions.TESTED.items():
        lower = spec.split(",")[0]
        assert requires[package] == package + lower, requires[package]
    assert not any("<" in r for r in kwargs["install_requires"]), kwargs["install_requires"]
    assert versions.minimum("trl") == (1, 10) and versions.minimum("transformers") == (5, 23)


def test_ci_and_constraints_pin_tested_releases_and_the_docs_state_the_ranges():
    pins = dict(
        line.split("==") for line in _read("constraints.txt").splitlines() if line.strip() and not line.startswith("#")
    )
    assert sorted(pins) == sorted(versions.TESTED)
    for package, version in pins.items():
        assert versions.is_tested(package, version), (package, version)
    assert '-e ".[cli,test]" -c constraints.txt' in _read(".ci/run")
    compatibility = _read("docs/compatibility.md")
    for package, spec in versions.TESTED.items():
        assert f"`{package}{spec}`" in compatibility, f"docs/compatibility.md does not state {package}{spec}"
        assert f"{package}=={pins[package]}" in compatibility


@pytest.mark.parametrize(
    "package,version,tested",
    [
        ("transformers", "5.23.0", True),
        ("transformers", "5.24.0", True),
        ("transformers", "5.24.1.dev0", True),
        ("transformers", "5.25.0", True),
        ("transformers", "5.26.0", False),
        ("transformers", "5.22.2", False),
        ("trl", "1.10.0", True),
        ("trl", "1.16.0", True),
        ("trl", "1.17.0", False),
        ("accelerate", "1.15.0", True),
        ("accelerate", "1.16.0", True),
        ("accelerate", "1.17.0", False),
        ("trl", "2.0.0", False),
    ],
)
def test_is_tested(package, version, tested):
    assert versions.is_tested(package, version) is tested


def test_unknown_package_is_named():
    with pytest.raises(ValueError, match=r"no tested range for package 'peft'; known: accelerate, transformers, trl"):
        versions.is_tested("peft", "1.0")


@pytest.fixture
def fake_release(monkeypatch):
    """``fake_release(package, version)``: the installed ``package`` reports ``version``; warnings not yet given."""
    import importlib

    monkeypatch.setattr(versions, "_warned", set())

    def fake(package, version):
        monkeypatch.setattr(importlib.import_module(package), "__version__", version)

    return fake


def _batch():
    ids, mask, C, _ = make_batch([6, 9], G=3, C=4, seed=3)
    return ids, mask, C


def test_untested_transformers_warns_once_and_always_confirms(fake_release, monkeypatch):
    """transformers 5.25.0 (faked): one warning naming it and the range; ``confirm=False`` and GRPO_MEM_CONFIRM=0
    are overridden, so the model class is confirmed on a tiny copy before it takes the prompt-once path (its numbers
    equal stock TRL's), and a class the confirmation does not pass is served by the stock path, with the cause."""
    import grpo_mem

    monkeypatch.setenv(confirm.ENV, "0")
    model = tiny_model("llama", seed=1)
    ids, mask, C = _batch()
    ref, _ = stock_logps(model, ids, mask, C)
    confirm.forget()
    try:
        grpo_mem.shared_prompt_logprobs(model, ids, mask, C, confirm=False)
        assert confirm.verdicts() == {}, "tested release: confirm=False is honoured"

        fake_release("transformers", "5.26.0")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ours, _ = grpo_mem.shared_prompt_logprobs(model, ids, mask, C, confirm=False)
            grpo_mem.shared_prompt_logprobs(model, ids, mask, C, confirm=False)
        untested = [str(w.message) for w in caught if issubclass(w.category, versions.UntestedReleaseWarning)]
        assert (
            len(untested) == 1
            and "transformers 5.26.0 is outside the tested range transformers>=5.23,<5.26" in (untested[0])
        )
        assert not any("falling back" in str(w.message) for w in caught)
        (verdict,) = confirm.verdicts().values()
        assert verdict.cause is None
        assert_close(ours, ref, 1e-5, "log-probs", mask=mask[:, -C:])

        confirm.forget()  # a class whose tiny copy differs: the stock path, the cause named
        monkeypatch.setattr(confirm, "_compare", lambda *a, **k: ("not confirmed: differs (test)", None))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fallback, _ = grpo_mem.shared_prompt_logprobs(model, ids, mask, C, confirm=False)
        assert any("falling back" in str(w.message) and "differs (test)" in str(w.message) for w in caught)
        assert_close(fallback, ref, 1e-5, "log-probs", mask=mask[:, -C:])
    finally:
        confirm.forget()
        grpo_mem.restore(model)


def test_untested_trl_warns_once_patches_known_signatures_and_refuses_others(fake_release):
    """TRL 1.17.0 (faked): ``patch_trl`` warns once naming it and the range, patches a trainer class whose methods
    have the signatures it knows, and refuses by name one whose scoring method takes another parameter; TRL older
    than the range is refused."""
    import grpo_mem
    from trl import GRPOTrainer

    fake_release("trl", "1.17.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with grpo_mem.patch_trl(GRPOTrainer) as handle:
            assert handle.targets == ["GRPOTrainer"]
        grpo_mem.patch_trl(GRPOTrainer).revert()
    untested = [str(w.message) for w in caught if issubclass(w.category, versions.UntestedReleaseWarning)]
    assert len(untested) == 1 and "trl 1.17.0 is outside the tested range trl>=1.10,<1.17" in untested[0]

    class Changed(GRPOTrainer):
        def _get_per_token_logps_and_entropies(
            self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, sampling_mask=None
        ):
            raise AssertionError("never called")

    with pytest.raises(TypeError, match=r"_get_per_token_logps_and_entropies of .*Changed.* has parameters"):
        grpo_mem.patch_trl(Changed)
    assert "__grpo_mem_patch__" not in vars(Changed)["_get_per_token_logps_and_entropies"].__dict__

    fake_release("trl", "1.9.2")
    with pytest.raises(RuntimeError, match=r"grpo_mem needs TRL >= 1\.10 .*found trl 1\.9\.2"):
        grpo_mem.patch_trl(GRPOTrainer)


def test_tested_releases_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", versions.UntestedReleaseWarning)
        assert versions.check_tested("transformers") and versions.check_tested("trl")
