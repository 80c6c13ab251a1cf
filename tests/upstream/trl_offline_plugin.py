"""pytest plugin for TRL's own tests run offline, stock or with grpo_mem's patch (loaded by ``run_trl.py`` with
``-p trl_offline_plugin``; not a conftest, so the repository's own suite never loads it).

Read from the environment the runner sets:

- ``GRPO_MEM_UPSTREAM_CACHE``: the directory ``offline_assets`` wrote. Models resolve through the hub cache there
  (``HF_HUB_CACHE``, ``HF_HUB_OFFLINE=1``, set by the runner), text stand-ins' tokenizers too; this plugin resolves
  the rest: ``AutoProcessor.from_pretrained("trl-internal-testing/<name>")`` of a vision-language stand-in builds
  its processor image-only, and ``datasets.load_dataset("trl-internal-testing/<name>", config, split=...,
  streaming=...)`` loads the saved stand-in (``streaming=True``: as an iterable dataset). A ``trl-internal-testing``
  name without a stand-in raises ``OSError`` naming it (nothing is downloaded).
- ``GRPO_MEM_UPSTREAM_DESELECT``: a JSON list of test names to deselect, each a test's name with its parameters
  (``test_x[a-b]``) or without (every parametrization of ``test_x``); exact names, not substrings.
- ``GRPO_MEM_UPSTREAM_MODE``: ``stock`` or ``patched``; ``patched`` applies ``grpo_mem.patch_trl`` (TRL's classes,
  default sharing) at session start for the whole session and reverts it at the end.
- ``GRPO_MEM_UPSTREAM_REPORT``: a JSON file written at the end: per test its outcome, a one-line error, and (patched)
  the mean of each logged ``grpo_mem/path/<name>`` fraction over the test's logged steps plus every fallback cause
  grpo_mem gave (``fallback.recording_fallbacks``), so one can tell which tests took the prompt-once path; and the
  norm of each parameter's gradient at the first trainer's (``GRPOTrainer`` or ``RLOOTrainer``) first optimizer
  step that has a gradient, to set the two runs side by side (TRL's tests only check that parameters moved).
- ``GRPO_MEM_UPSTREAM_FP32``: ``1`` trains in fp32 (``bf16=False`` for every ``GRPOConfig`` and ``RLOOConfig``,
  whose default is bf16 autocast), so the two runs' gradients can be compared at fp32 rounding.
- ``GRPO_MEM_UPSTREAM_GROUP_SHUFFLE``: ``1`` keeps ``patch_trl``'s group-aware shuffle; by default the patched run
  uses ``group_shuffle=False``, so both runs put the same rows in the same micro-batches and their first steps'
  gradients are comparable (grpo_mem still forwards a split group's prompt once per step).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

from grpo_mem.commands.report import PATH_PREFIX

ORG = "trl-internal-testing/"

_records: dict[str, dict] = {}
_trainers: list = []
_restore: list = []
_MISSING = object()


def _cache() -> Path:
    value = os.environ.get("GRPO_MEM_UPSTREAM_CACHE")
    if not value:
        raise RuntimeError("GRPO_MEM_UPSTREAM_CACHE is not set: run the tests through tests/upstream/run_trl.py")
    return Path(value)


def _patch(owner, name: str, replacement) -> None:
    """Set ``owner.name`` to ``replacement``, remembering what to put back at the end of the session."""
    _restore.append((owner, name, owner.__dict__.get(name, _MISSING)))
    setattr(owner, name, replacement)


def _install_resolvers() -> None:
    import datasets
    import transformers
    from offline_assets import load_processor, snapshot_dir

    original_processor = transformers.AutoProcessor.from_pretrained.__func__
    original_dataset = datasets.load_dataset

    def processor_from_pretrained(cls, name, *args, **kwargs):
        if not (isinstance(name, str) and name.startswith(ORG)):
            return original_processor(cls, name, *args, **kwargs)
        snapshot = snapshot_dir(_cache(), name)
        if not (snapshot / "offline_processor.json").is_file():  # a text stand-in: its tokenizer, from the hub cache
            return original_processor(cls, name, *args, **kwargs)
        return load_processor(snapshot, **kwargs)

    def load_dataset(path, name=None, *args, split=None, streaming=False, **kwargs):
        if not (isinstance(path, str) and path.startswith(ORG)):
            return original_dataset(path, name, *args, split=split, streaming=streaming, **kwargs)
        where = _cache() / "datasets" / path[len(ORG) :] / (name or "default")
        if not where.is_dir():
            raise OSError(f"no offline stand-in for the dataset {path!r} (config {name!r}) under {_cache()}")
        data = datasets.load_from_disk(str(where))
        if streaming:
            data = datasets.IterableDatasetDict({key: part.to_iterable_dataset() for key, part in data.items()})
        return data if split is None else data[split]

    _patch(transformers.AutoProcessor, "from_pretrained", classmethod(processor_from_pretrained))
    _patch(datasets, "load_dataset", load_dataset)


def _first_step_gradients():
    """A ``TrainerCallback`` keeping, as ``.norms``, each parameter's gradient norm (fp64) at the first optimizer step
    with a non-zero gradient (before it, GRPO's advantages were all zero and nothing moved), after TRL's clipping
    (which scales every gradient of a step by one factor), and that step's number as ``.step``."""
    from transformers import TrainerCallback

    class FirstStepGradients(TrainerCallback):
        norms: dict | None = None
        step: int | None = None

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if self.norms is None:
                norms = {
                    n: float(p.grad.detach().double().norm()) for n, p in model.named_parameters() if p.grad is not None
                }
                if any(norms.values()):
                    self.norms, self.step = norms, state.global_step + 1

    return FirstStepGradients()


def _install_trainer_log() -> None:
    """Remember every GRPOTrainer or RLOOTrainer a test trains (with a ``_first_step_gradients`` callback added), to
    read its ``log_history`` and first gradients after the test."""
    import trl

    def logged(original):
        def train(self, *args, **kwargs):
            callback = _first_step_gradients()
            self.add_callback(callback)
            _trainers.append((self, callback))
            return original(self, *args, **kwargs)

        return train

    for trainer in (trl.GRPOTrainer, trl.RLOOTrainer):
        _patch(trainer, "train", logged(trainer.train))


def _install_availability_checks() -> None:
    """Let ``from trl.import_utils import is_<package>_available`` succeed for helpers the installed TRL does not
    define (TRL's ``tests/testing_utils.py`` of another release imports some, e.g. ``is_joblib_available`` which 1.16
    dropped): such a name answers whether ``<package>`` is importable, as TRL's own helpers do."""
    import importlib
    import importlib.util

    module = importlib.import_module("trl.import_utils")

    def availability(name: str):
        package = (
            name[len("is_") : -len("_available")] if name.startswith("is_") and name.endswith("_available") else ""
        )
        if not package:
            raise AttributeError(f"module 'trl.import_utils' has no attribute {name!r}")
        return lambda *args, **kwargs: importlib.util.find_spec(package) is not None

    _patch(module, "__getattr__", availability)


def _install_fp32() -> None:
    """Every ``GRPOConfig`` or ``RLOOConfig`` built without an explicit ``bf16`` trains in fp32 (TRL's default is
    ``bf16=True``)."""
    import trl

    def fp32(original):
        def post_init(self):
            if self.bf16 is None:
                self.bf16 = False
            original(self)

        return post_init

    for config in (trl.GRPOConfig, trl.RLOOConfig):
        _patch(config, "__post_init__", fp32(config.__post_init__))


def pytest_configure(config):
    mode = os.environ.get("GRPO_MEM_UPSTREAM_MODE", "stock")
    if mode not in ("stock", "patched"):
        raise ValueError(f"GRPO_MEM_UPSTREAM_MODE must be 'stock' or 'patched', got {mode!r}")
    if os.environ.get("HF_HUB_OFFLINE") != "1":
        raise RuntimeError("HF_HUB_OFFLINE must be 1: these runs must never reach the hub")
    _install_resolvers()
    _install_availability_checks()
    _install_trainer_log()
    if os.environ.get("GRPO_MEM_UPSTREAM_FP32") == "1":
        _install_fp32()
    if mode == "patched":
        import grpo_mem

        shuffle = os.environ.get("GRPO_MEM_UPSTREAM_GROUP_SHUFFLE") == "1"
        config._grpo_mem_handle = grpo_mem.patch_trl(group_shuffle=shuffle)


def pytest_collection_modifyitems(config, items):
    """Deselect the tests ``GRPO_MEM_UPSTREAM_DESELECT`` names (by name with parameters, or by function name)."""
    names = set(json.loads(os.environ.get("GRPO_MEM_UPSTREAM_DESELECT") or "[]"))
    if not names:
        return
    keep, drop = [], []
    for item in items:
        (drop if {item.name, getattr(item, "originalname", item.name)} & names else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_unconfigure(config):
    handle = getattr(config, "_grpo_mem_handle", None)
    if handle is not None:
        handle.revert()
    while _restore:
        owner, name, value = _restore.pop()
        if value is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, value)


def _paths(trainers) -> dict[str, float]:
    """Mean over the trainers' logged steps of each ``grpo_mem/path/<name>`` fraction."""
    sums, counts = defaultdict(float), defaultdict(int)
    for trainer, _ in trainers:
        for logs in trainer.state.log_history:
            for key, value in logs.items():
                if key.startswith(PATH_PREFIX):
                    sums[key[len(PATH_PREFIX) :]] += float(value)
                    counts[key[len(PATH_PREFIX) :]] += 1
    return {name: round(sums[name] / counts[name], 4) for name in sorted(sums)}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    from grpo_mem.model.fallback import recording_fallbacks

    _trainers.clear()
    with recording_fallbacks() as causes:
        yield
    record = _records.setdefault(item.nodeid, {})
    record["paths"] = _paths(_trainers)
    record["fallbacks"] = sorted(set(causes))
    record["steps"] = sum(t.state.global_step for t, _ in _trainers)
    record["first_step_grad_norms"] = _trainers[0][1].norms if _trainers else None
    record["first_step"] = _trainers[0][1].step if _trainers else None
    _trainers.clear()


def pytest_runtest_logreport(report):
    record = _records.setdefault(report.nodeid, {})
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        outcome = "xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome
        record["outcome"] = outcome
        if report.failed:
            lines = [line for line in str(report.longrepr).splitlines() if line.startswith("E ")]
            record["error"] = (lines[0][1:].strip() if lines else str(report.longrepr).splitlines()[-1])[:300]
        elif report.skipped and isinstance(report.longrepr, tuple):
            record["error"] = str(report.longrepr[2])[:300]


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("GRPO_MEM_UPSTREAM_REPORT")
    if out:
        Path(out).write_text(json.dumps(_records, indent=1, sort_keys=True))
