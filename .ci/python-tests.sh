#!/usr/bin/env bash
# The Python package (python/): builds it with maturin into a virtual environment under
# target/ (kept between runs), installs it the way the README says, and runs its pytest
# suite. numpy-level tests (the Rust core, tidestore.aio) always run; the torch-level
# tests need torch, the CUDA build from PyPI (about 3 GB downloaded, 5.4 GB installed,
# 70 s on the dev machine), which is installed only where the disk has room for it
# (TIDESTORE_PY_TORCH=1 forces it, =0 skips it); otherwise they skip, printing why.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv=target/py-venv
# maturin's PEP 517 hooks run the `maturin` executable from PATH.
export PATH="$PWD/$venv/bin:$PATH"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    "maturin>=1.5,<2" "pytest>=7" "numpy>=1.21"

if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
    free_gib=$(df -Pk target | awk 'NR==2 { print int($4 / 1048576) }')
    want=${TIDESTORE_PY_TORCH:-auto}
    if [ "$want" = 1 ] || { [ "$want" = auto ] && [ "$free_gib" -ge 20 ]; }; then
        echo "installing torch from PyPI (${free_gib} GiB free)"
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir torch
    else
        echo "not installing torch (${free_gib} GiB free, 20 GiB wanted; TIDESTORE_PY_TORCH=${want}): the torch-level tests skip"
    fi
fi

# transformers, peft and accelerate (pure Python) for the engine's model tests
# (transformers models, LoRA, Trainer), wherever torch is.
if "$venv/bin/python" -c "import torch" >/dev/null 2>&1 \
    && ! "$venv/bin/python" -c "import transformers, peft, accelerate" >/dev/null 2>&1; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        "transformers>=4.45" peft accelerate
fi

# The README's install command, with the build tools already in the environment.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-build-isolation ./python
# From the repository root, so `import tidestore` is the installed package, not python/tidestore.
"$venv/bin/python" -m pytest -rs python/tests "$@"
