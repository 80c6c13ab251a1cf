#!/usr/bin/env bash
# Run grpo_mem's TRL parity tests against one TRL release, in a throwaway virtual environment.
#
#   bash tests/compat/run.sh 1.15.0            # TRL 1.15.0 with transformers 5.23.0 (the version CI uses)
#   TRANSFORMERS_VERSION=5.10.0 bash tests/compat/run.sh 1.13.0
#   KEEP_VENV=1 bash tests/compat/run.sh 1.13.0   # keep the venv (printed) for a rerun; COMPAT_VENV=DIR reuses one
#   COMPAT_TESTS=all TRANSFORMERS_VERSION=5.23.0 bash tests/compat/run.sh 1.16.0   # the whole suite on that release
#   TRITON_VERSION=3.6.0 COMPAT_TESTS="tests/ops/test_attention_triton_aot.py tests/ops/test_logprobs_triton_aot.py" \
#       bash tests/compat/run.sh 1.16.0   # the AOT kernel builds under another triton (3.6.0: the GPU image's)
#
# COMPAT_TESTS=all runs the whole suite (the README's test command, slow runs included) in a venv built over this
# machine's own packages (--system-site-packages: the project installed as the README says, its extension built, the
# test and cli extras present), with only transformers and trl pinned inside the venv, so that the release under test
# is the one difference from the machine's own environment. Otherwise:
#
# The venv is a fresh one (not --system-site-packages, which would see the TRL installed next to it): torch
# TORCH_VERSION (2.13.0 unless set; 2.13.0 is a CPU wheel here, while PyPI's torch 2.11.0 is the CUDA build, 530.6 MB
# plus the CUDA libraries), triton TRITON_VERSION (3.9.0 unless set; the AOT tests compile with it, so
# TRITON_VERSION=3.6.0 shows the builds of the GPU image's triton, torch 2.13.0 CPU next to it), the pinned
# transformers, trl==TRL_VERSION and the test dependencies (requests too: TRL 1.10-1.14 import it from
# trl.generation.vllm_client without declaring it; liger-kernel for tests/patches/test_liger.py, as TRL and
# transformers refuse use_liger_kernel without it), then this repository
# installed editable without dependencies and without building the C++ extension (GRPO_MEM_SKIP_EXT=1: the parity
# tests run the torch paths then). Runs the tests that exercise TRL (COMPAT_TESTS to override), with the "slow"
# multi-process runs deselected. TRL 1.15's fused LM head runs a Triton kernel on every device (1.16 added a torch
# path for CPU), so stock TRL 1.15 cannot score on CPU at all ("0 active drivers"); for such a release the tests run
# with TRITON_INTERPRET=1, which makes Triton execute that kernel on CPU tensors (grpo_mem's own "auto" backends never
# pick the interpreter, so only stock TRL is affected). Prints one result line:
#   compat trl=1.15.0 transformers=5.23.0: 61 passed, 0 failed, 2 skipped in 214 s (exit 0)
# and exits with pytest's status (non-zero on any failure, or 3 when the environment could not be built).
set -uo pipefail

TRL_VERSION=${1:?usage: tests/compat/run.sh TRL_VERSION}
TRANSFORMERS_VERSION=${TRANSFORMERS_VERSION:-5.23.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TRITON_VERSION=${TRITON_VERSION:-3.9.0}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
FULL=
[ "${COMPAT_TESTS:-}" = all ] && FULL=1
TESTS=${COMPAT_TESTS:-tests/patches/test_patch_trl.py tests/model/test_group_sharing.py tests/model/test_tree_sharing.py tests/patches/test_verify.py tests/ops/test_flash_attention.py tests/patches/test_liger.py}
VENV=${COMPAT_VENV:-$(mktemp -d -t "grpo-mem-trl-$TRL_VERSION-XXXX")}
LOG=$VENV/compat.log
start=$(date +%s)

cleanup() { [ -n "${KEEP_VENV:-}" ] || [ -n "${COMPAT_VENV:-}" ] || rm -rf "$VENV"; }
trap cleanup EXIT

if [ ! -x "$VENV/bin/python" ] && [ -n "$FULL" ]; then
    python3 -m venv --system-site-packages "$VENV" || { echo "compat trl=$TRL_VERSION: could not create a venv"; exit 3; }
    "$VENV/bin/pip" install -q "transformers==$TRANSFORMERS_VERSION" "trl==$TRL_VERSION" >"$LOG" 2>&1 || {
        tail -20 "$LOG"
        echo "compat trl=$TRL_VERSION transformers=$TRANSFORMERS_VERSION: environment could not be built (log above)"
        exit 3
    }
elif [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV" || { echo "compat trl=$TRL_VERSION: could not create a venv"; exit 3; }
    {
        "$VENV/bin/pip" install -q "torch==$TORCH_VERSION" "triton==$TRITON_VERSION" &&
        "$VENV/bin/pip" install -q "transformers==$TRANSFORMERS_VERSION" "trl==$TRL_VERSION" accelerate==1.15.0 \
            datasets pytest peft==0.21.2 requests liger-kernel==0.8.5 &&
        GRPO_MEM_SKIP_EXT=1 "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e "$REPO"
    } >"$LOG" 2>&1 || {
        tail -20 "$LOG"
        echo "compat trl=$TRL_VERSION transformers=$TRANSFORMERS_VERSION: environment could not be built (log above)"
        exit 3
    }
fi
got=$("$VENV/bin/python" -c "import trl, transformers; print(trl.__version__, transformers.__version__)")
if [ "$got" != "$TRL_VERSION $TRANSFORMERS_VERSION" ]; then
    echo "compat: the venv holds trl/transformers $got, expected $TRL_VERSION $TRANSFORMERS_VERSION"
    exit 3
fi
stack=$("$VENV/bin/python" -c "import torch, triton; print(torch.__version__.split('+')[0], triton.__version__)")
if [ -z "$FULL" ] && [ "$stack" != "$TORCH_VERSION $TRITON_VERSION" ]; then
    echo "compat: the venv holds torch/triton $stack, expected $TORCH_VERSION $TRITON_VERSION"
    exit 3
fi

kernel=$("$VENV/bin/python" -c "import os, trl; print(os.path.join(os.path.dirname(trl.__file__), 'kernels', 'chunked_logprob.py'))")
if [ -f "$kernel" ] && ! grep -q "_use_triton" "$kernel"; then
    export TRITON_INTERPRET=1  # stock TRL's fused head is Triton-only in this release
fi

cd "$REPO" || exit 3
# -p no:cacheprovider: leave no .pytest_cache behind; the grpo_mem imported is this repository's (editable install)
if [ -n "$FULL" ]; then
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider 2>&1 | tee "$VENV/pytest.log"
else
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" $TESTS 2>&1 | tee "$VENV/pytest.log"
fi
status=${PIPESTATUS[0]}
summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed|error)" "$VENV/pytest.log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
echo "compat trl=$TRL_VERSION transformers=$TRANSFORMERS_VERSION torch/triton=${stack// //}${TRITON_INTERPRET:+ TRITON_INTERPRET=1}: ${summary:-no pytest summary} ($(( $(date +%s) - start )) s wall, exit $status)${KEEP_VENV:+ venv $VENV}"
exit "$status"
