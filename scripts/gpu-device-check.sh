#!/usr/bin/env bash
# Run `saccade bench gpu` on this CPU the way a lent GPU machine runs it, before spending its time.
#
# Why: the lent H100/H200 machines have their own Python (3.12) and packages (torch 2.11,
# transformers 5.17, ...; docs/gpu-runs.md, "Running the GPU checks"), no pydantic and no
# registry. saccade runs there from source with only the wheels that scripts/gpu-wheels.sh
# downloads into .whl/. An import that the machine lacks and the wheels don't bring costs a
# lease (the machine starts, the command dies at its first import). This script finds it here.
#
# What it does:
#   1. makes (or reuses) a throwaway venv, .gpu-venv/ (git-ignored), holding the GPU machine's
#      packages at the versions the machine was seen with: Python 3.12 (uv's download, else a
#      python3.12 found on this machine; else the newest Python here, said so loudly), torch
#      2.11.0 (the registry's build: the CPU-only build's index is not reachable from here; it
#      runs on the CPU and brings the nvidia-* and triton packages the machine also has),
#      transformers 5.17.0, torchvision 0.26.0 and the rest of MACHINE_PINS below. Never pydantic.
#      It is rebuilt only when MACHINE_PINS or the Python changes (a hash in .gpu-venv/.pins).
#      The venv must hold nothing that the machine's image lacks (MACHINE_HAS, the image's package
#      names): a package that resolved in beside the pins and is not there fails the check (exit 2);
#   2. installs .whl/*.whl (downloaded by scripts/gpu-wheels.sh when .whl/ is missing or older
#      than that script) into a fresh temporary SITE folder exactly as the GPU machine does
#      (/tmp/site there): pip, no index, no deps, --target;
#   3. runs, from the checkout's root with PYTHONPATH=SITE:src and that venv's python
#      first on PATH, `python -m saccade bench gpu ARGS --out DIR`: ARGS are this script's
#      arguments (default `--device cpu --quick`), DIR a fresh temporary folder unless ARGS name
#      `--out`;
#   4. prints the versions it ran under and the exit code, and exits non-zero if the bench did,
#      or if its output or its stages' log names a missing module (ModuleNotFoundError, "No module
#      named"): an import the GPU machine would not find either.
#
#   scripts/gpu-device-check.sh                                # every stage, quick, on the CPU
#   scripts/gpu-device-check.sh --device cpu --quick --stage syncs   # one stage
#   scripts/gpu-device-check.sh --lease --device cpu --quick         # any arguments of `bench gpu`
#
# What a CPU cannot show: flash-linear-attention's kernels are Triton on CUDA. Its wheels install
# and import here as there, and where fla imports, transformers' Qwen3.5 layers call its chunk
# kernel on any device; so the Qwen3.5 stages that run the layer's own forward on the CPU
# (parity-qwen3.5-9b, trainer-lora-qwen3.5-9b with --device cpu) fail here with Triton's
# "0 active drivers", which on the GPU machine, on CUDA tensors, they do not meet.
#
# Here the venv is filled from the registry (the GPU machine has none; only the set of packages
# must match). The first run downloads about 3 GB (torch and its nvidia-* packages) unless uv's
# cache holds them; a rerun with the venv in place takes seconds before the bench starts.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.gpu-venv

# The GPU machine's packages that saccade, torch, transformers, peft and accelerate import, at the
# versions its pip list showed (torch, torchvision, triton, transformers, accelerate,
# huggingface-hub, numpy, safetensors, tokenizers). The others' versions there were not read:
# uv.lock's, the versions the CPU tests ran against.
MACHINE_PINS=(
    "torch==2.11.0"
    "torchvision==0.26.0"
    "triton==3.6.0"
    "transformers==5.17.0"
    "accelerate==1.15.0"
    "huggingface-hub==1.33.0"
    "numpy==2.5.2"
    "safetensors==0.8.0"
    "tokenizers==0.23.2"
    "peft==0.21.2"
    "pillow==13.0.0"
    "rich==15.0.0"
    "httpx==0.28.1"
    "matplotlib==3.11.2"
    "packaging==26.3"
    "einops==0.8.2"
    "typing-extensions==4.16.0"
    "tqdm==4.70.1"
    "pyyaml==6.0.3"
    "regex==2026.11.15"
    "filelock==4.2.11"
    "fsspec==2026.9.0"
    "jinja2==3.1.6"
    "psutil==7.2.2"
    "pyarrow==26.0.1"
    "aiohttp==3.14.5"
    "uvloop==0.23.0"
    # transformers needs typer; typer 0.29 needs pydantic, which the machine lacks: its typer is
    # older. matplotlib needs python-dateutil; 4.0 needs tzdata, which the machine lacks.
    "typer==0.28.0"
    "python-dateutil==2.9.0.post0"
)
# The GPU machine image's Python packages (names, as read there on 2026-11-17). No pydantic,
# msgspec, datasets, math-verify, trimesh, fastapi, vllm, flash-attn, wandb, tensorboardX.
MACHINE_HAS="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio
h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"

say() { printf '[gpu-device-check] %s\n' "$*" >&2; }

# --- 1. Python 3.12 ------------------------------------------------------------------------------
find_python() {
    local p
    if command -v uv >/dev/null; then
        if timeout 300 uv python install 3.12 >/dev/null 2>&1; then
            p=$(uv python find --managed-python 3.12 2>/dev/null || true)
            [[ -n $p ]] && { echo "$p"; return; }
        fi
        say "uv could not download Python 3.12 (no route to its download host from here); looking on this machine"
    fi
    for p in $(command -v python3.12 || true) /usr/bin/python3.12 /usr/local/bin/python3.12 \
             "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
        [[ -x $p ]] && "$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null \
            && { echo "$p"; return; }
    done
    # No 3.12: the newest Python 3 here, said so.
    p=$(for c in $(compgen -c python3. | sort -u) "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.*/bin/python3.*[0-9]; do
            command -v "$c" 2>/dev/null || { [[ -x $c ]] && echo "$c"; }
        done | while read -r c; do
            v=$("$c" -c 'import sys; print("%d %d" % sys.version_info[:2])' 2>/dev/null) && echo "$v $c"
        done | sort -k1,1n -k2,2n | tail -1 | cut -d' ' -f3-)
    [[ -n $p ]] || { say "no Python 3 found"; exit 2; }
    say "WARNING: no Python 3.12 here: falling back to $p ($("$p" -V 2>&1)); the GPU machine runs 3.12"
    echo "$p"
}

PY=$(find_python)
PY_VERSION=$("$PY" -c 'import sys; print(sys.version.split()[0])')
PINS_HASH=$(printf '%s\n' "$PY_VERSION" "${MACHINE_PINS[@]}" | sha256sum | cut -d' ' -f1)

if [[ -f $VENV/.pins && $(cat "$VENV/.pins") == "$PINS_HASH" && -x $VENV/bin/python ]]; then
    say "reusing $VENV (Python $PY_VERSION, pins unchanged)"
else
    say "building $VENV: Python $PY_VERSION ($PY) and the GPU machine's packages"
    rm -rf "$VENV"
    if command -v uv >/dev/null; then
        uv venv --quiet --seed --python "$PY" "$VENV"
        uv pip install --quiet --python "$VENV/bin/python" "${MACHINE_PINS[@]}"
    else
        "$PY" -m venv "$VENV"
        "$VENV/bin/python" -m pip install --quiet "${MACHINE_PINS[@]}"
    fi
    # The machine's image has pip, setuptools and wheel.
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check setuptools wheel
    echo "$PINS_HASH" > "$VENV/.pins"
fi
# Nothing that the machine's image lacks (checked on every run: a package resolved in beside the
# pins, or installed here by hand, would hide a missing import).
extra=$(MACHINE_HAS="$MACHINE_HAS" "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md, os, re
has = set(os.environ["MACHINE_HAS"].split())
names = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower() for d in md.distributions()}
print(" ".join(sorted(names - has)))
EOF
)
if [[ -n $extra ]]; then
    say "FAILED: $VENV holds packages that the GPU machine's image lacks: $extra"
    say "(pin what pulls them in to a version that does not, or delete $VENV if they were installed by hand)"
    exit 2
fi

# --- 2. the wheels, as the GPU machine installs them ---------------------------------------------
if [[ ! -d .whl || scripts/gpu-wheels.sh -nt .whl ]]; then
    say "downloading the wheels: scripts/gpu-wheels.sh"
    scripts/gpu-wheels.sh >&2
fi
SITE=$(mktemp -d -t gpu-device-check-site.XXXXXX)
trap 'rm -rf "$SITE"' EXIT
"$VENV/bin/python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl

# --- 3. the lease's code path on the CPU ---------------------------------------------------------
ARGS=("$@")
[[ ${#ARGS[@]} -gt 0 ]] || ARGS=(--device cpu --quick)
OUT_DIR=""
for i in "${!ARGS[@]}"; do
    case ${ARGS[$i]} in
        --out) OUT_DIR=${ARGS[$((i + 1))]:-} ;;
        --out=*) OUT_DIR=${ARGS[$i]#--out=} ;;
    esac
done
if [[ -z $OUT_DIR ]]; then
    OUT_DIR=$(mktemp -d -t gpu-device-check.XXXXXX)
    ARGS+=(--out "$OUT_DIR")
fi
LOG=$(mktemp -t gpu-device-check.XXXXXX.log)

# The machine's environment as far as it matters: its python first on PATH (torchrun's
# `python -m torch.distributed.run` takes sys.executable), saccade from src/ and the wheels'
# --target, not installed; no user site, no other venv.
export PATH="$VENV/bin:$PATH" PYTHONPATH="$SITE:src" PYTHONNOUSERSITE=1 PYTHONUNBUFFERED=1
unset VIRTUAL_ENV PYTHONHOME CONDA_PREFIX

say "running: PYTHONPATH=$PYTHONPATH python -m saccade bench gpu ${ARGS[*]}"
set +e
python -m saccade bench gpu "${ARGS[@]}" 2>&1 | tee "$LOG"
RC=${PIPESTATUS[0]}
set -e

# --- 4. what it ran under, and what it found -----------------------------------------------------
echo
echo "== gpu-device-check: ran under"
SITE=$SITE python - <<'EOF'
import importlib, os, platform, sys, warnings
warnings.simplefilter("ignore")
print(f"python            {platform.python_version()} ({sys.executable})")
for mod in ("torch", "transformers", "triton", "peft", "accelerate", "torchvision", "numpy",
            "pydantic", "typing_extensions", "fla"):
    try:
        m = importlib.import_module(mod)
        v = getattr(m, "__version__", None)
        if v is None:
            from importlib.metadata import version
            v = version({"fla": "flash-linear-attention"}.get(mod, mod.replace("_", "-")))
        where = "wheel" if (getattr(m, "__file__", "") or "").startswith(os.environ["SITE"]) else "venv"
        print(f"{mod:<17} {v} ({where})")
    except Exception as e:  # noqa: BLE001 - report, not fail: absent is a reading
        print(f"{mod:<17} absent ({type(e).__name__}: {e})")
EOF
MISSING=$(grep -h -E "ModuleNotFoundError|No module named" "$LOG" \
          $( [[ -f $OUT_DIR/bench-gpu.log ]] && echo "$OUT_DIR/bench-gpu.log" ) 2>/dev/null | sort -u || true)
echo "out               $OUT_DIR (log: $LOG)"
echo "exit code         $RC (saccade bench gpu ${ARGS[*]})"
if grep -q "0 active drivers" "$LOG"; then
    echo "note: Triton found no driver: fla's kernels ran on CPU tensors, which a CPU run alone meets (the header says why)"
fi
if [[ -n $MISSING ]]; then
    echo "== FAILED: a missing import, which the GPU machine would hit too:"
    echo "$MISSING"
    [[ $RC -ne 0 ]] || RC=2
fi
exit "$RC"
