#!/usr/bin/env bash
# The one script to run on a GPU machine (repository root as working directory):
#
#   tools/gpu_run.sh [bench.one_gpu arguments]     # on the GPU machine: versions, nvidia-smi, then the bench
#   tools/gpu_run.sh --fill-deps                   # here, once: fill .gpu_deps/ from .venv and check it
#
# The GPU machine has torch, lightning and transformers (and what they depend on:
# numpy, PyYAML, packaging, safetensors...) but not the project's other
# dependencies. .gpu_deps/ (ignored by git, about 35 MiB) holds copies of those
# pure-Python packages, taken from .venv: hydra, omegaconf, antlr4 (their
# parser), pulp (the planner's integer programs, with its Linux x86-64 CBC
# solver only), rich with markdown_it, mdurl and pygments (plan tables).
# matplotlib is not carried: only the timeline plot imports it, when asked.
# Carry it to the device with the run tool's carry=[".gpu_deps"].
#
# Environment: BENCH_TIMEOUT_S (default 540): the whole bench's limit; PYTHON (default python3, or .venv's
# python where one exists and --fill-deps is given).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEPS=$ROOT/.gpu_deps
CARRIED=(hydra omegaconf antlr4 pulp rich markdown_it mdurl pygments pytest _pytest pluggy iniconfig py.py)

fill_deps() {
    local python=${PYTHON:-.venv/bin/python}
    local site
    site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    rm -rf "$DEPS"
    mkdir -p "$DEPS"
    for package in "${CARRIED[@]}"; do
        cp -a "$site/$package" "$DEPS/"
    done  # pytest and its own: for the tests that only a GPU runs (GPU_TESTS below)
    # pulp ships CBC for every platform: keep the Linux x86-64 binary only.
    find "$DEPS/pulp/solverdir/cbc" -mindepth 1 -maxdepth 1 ! -name linux -exec rm -rf {} +
    find "$DEPS/pulp/solverdir/cbc/linux" -mindepth 1 -maxdepth 1 ! -name i64 -exec rm -rf {} +
    find "$DEPS" -name __pycache__ -type d -prune -exec rm -rf {} +
    echo "filled $DEPS: $(du -sh "$DEPS" | cut -f1)"

    # Check: a Python that sees .venv's site-packages WITHOUT the carried packages (as the GPU machine has
    # torch, lightning and transformers but not them) imports the strategy, the planner's solver and the
    # bench with the carried packages from .gpu_deps only.
    local bare
    bare=$(mktemp -d)
    trap 'rm -rf "$bare"' RETURN
    for entry in "$site"/*; do
        local name
        name=$(basename "$entry")
        local skip=0
        for package in "${CARRIED[@]}" matplotlib zorse_lightning; do
            case "$name" in
                "$package"|"$package"-*.dist-info|"${package//_/-}"-*.dist-info) skip=1 ;;
            esac
        done
        case "$name" in
            hydra_core-*|antlr4_python3_runtime-*|markdown_it_py-*|__editable__*|*zorse*) skip=1 ;;
        esac
        [ "$skip" = 1 ] || ln -s "$entry" "$bare/$name"
    done
    PYTHONNOUSERSITE=1 PYTHONPATH="$ROOT:$DEPS:$bare" "$python" -S - "$DEPS" <<'EOF'
import sys
deps = sys.argv[1]
import zorse_lightning.strategy.zorse_strategy  # noqa: F401  (the strategy's whole import path)
import zorse_lightning.planner.ilp  # noqa: F401
import zorse_lightning.reporting.plan_table  # noqa: F401
import zorse_lightning.models.causal_lm  # noqa: F401
import bench.one_gpu  # noqa: F401
import hydra, omegaconf, antlr4, pulp, rich  # noqa: E401
for module in (hydra, omegaconf, antlr4, pulp, rich):
    assert module.__file__.startswith(deps), (module.__name__, module.__file__)
assert "matplotlib" not in sys.modules, "matplotlib is imported on the strategy's path: carry it"
assert pulp.PULP_CBC_CMD(msg=False).available(), "pulp's CBC binary is missing or not executable"
problem = pulp.LpProblem("check", pulp.LpMinimize)
x = pulp.LpVariable("x", lowBound=1, cat="Integer")
problem += x
problem.solve(pulp.PULP_CBC_CMD(msg=False))
assert pulp.value(x) == 1
print("ok: zorse_lightning imports with hydra, omegaconf, antlr4, pulp, rich from", deps)
EOF
}

if [ "${1:-}" = "--fill-deps" ]; then
    fill_deps
    exit 0
fi

PYTHON=${PYTHON:-python3}
export PYTHONPATH="$ROOT:$DEPS${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [ ! -d "$DEPS/hydra" ]; then
    echo "warning: $DEPS is missing or incomplete: run tools/gpu_run.sh --fill-deps where .venv exists" >&2
fi
echo "== nvidia-smi"
nvidia-smi || echo "(no nvidia-smi)"
echo "== versions"
"$PYTHON" - <<'EOF'
import sys, torch, lightning
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| lightning", lightning.__version__, end=" ")
try:
    import transformers
    print("| transformers", transformers.__version__)
except ImportError:
    print("| transformers missing (the llama cases will fail)")
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
import zorse_lightning.strategy.zorse_strategy  # fails here, not in every run, when a dependency is missing
EOF
echo "== tests that need a GPU: ${GPU_TESTS:=tests/strategy/test_keep_from_host_copies.py}"
"$PYTHON" -m pytest -q -p no:cacheprovider -k gpu $GPU_TESTS || echo "(GPU tests failed: see above)"
echo "== bench.one_gpu $*"
timeout "${BENCH_TIMEOUT_S:-540}" "$PYTHON" -m bench.one_gpu "$@"
