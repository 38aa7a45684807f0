#!/usr/bin/env bash
# The GPU check: one command for one call of the lent GPU machine.
#
#   bash tools/gpu_check.sh [--quick] [--no-bench] [--no-conformance] [--sanitize] [--gpt2-bench|--gpt2-bench-only]
#
# 1. Makes the workspace importable with no network: every packages/*/src and plugins/*/src goes
#    on PYTHONPATH, and a generated .dist-info per member (METADATA + entry_points.txt from its
#    pyproject.toml) makes importlib.metadata find the entry points (plugins, hook specs, the
#    pytest plugin). No build backend is needed. Wheels carried in .whl/ are installed first.
# 2. pytest -m cuda: blutrain-alloc's tests in a process of their own (when its native core was built), then
#    the rest of packages/ and plugins/ (the fused-kernel tests against float64 references).
# 3. The conformance suite on device cuda, when blutrain.kernels.conformance exists.
# 4. tools/bench_kernels.py: ours against PyTorch, CUDA events, medians, random data.
# 5. With --sanitize: compute-sanitizer memcheck over the fused-kernel tests (the kernel library's test_cuda*.py,
#    the cuBLASLt epilogues, the compiler's generated fused kernels,
#    the cuBLAS binding and the fused LM-head loss), after the
#    benchmark: it is the slowest stage, and a call that runs out of time loses the least there.
# Environment: TESTS="pytest args" replaces the cuda-test selection (e.g. "packages/blutrain-kernels/tests/
# test_cuda_attention.py -k bfloat16"); BENCH="--only attention" is passed to the benchmark; GPT2=0 skips stage 3c;
# BENCH_ALLOC=1 adds tools/bench_alloc.py (allocation cost, a traced GPT-2 step and its memory plots).
# BENCH_GPT2=1 (or --gpt2-bench) adds tools/bench/gpt2.py, GPT-2 training beside PyTorch (docs/benchmarks.md),
# last; BENCH_GPT2=only (or --gpt2-bench-only) runs it alone after the workspace setup, within the call's
# 600 s (BENCH_GPT2_BUDGET); BENCH_GPT2_ARGS="--parity 200 --profile" is passed on. It writes $OUT/bench_gpt2/.
# BENCH_DIST=1 adds tools/bench/dist.py, the multi-GPU benchmark (BluTrain eager and compiled, DDP and ZeRO-1/2/3,
# beside PyTorch DDP and DDP + torch.compile on 1, 2, 4, ... GPUs up to every visible one; same losses on 1 and N
# GPUs), last; BENCH_DIST=only runs it alone after the workspace setup (BENCH_DIST_BUDGET, default 590 s of the
# call; its --budget is what is left of that, less 110 s); BENCH_DIST_ARGS="--gpus 4 --profile" is passed on.
# It writes $OUT/bench_dist/.
# On a multi-GPU machine TESTS="plugins/blutrain-comm-nccl" runs the NCCL plugin's cuda tests on 1 and 2 ranks.
# THEN="command" runs a command of your own last, in the same workspace, within THEN_BUDGET (default 590 s of the
# call): e.g. THEN="python3 tools/bench/dist_cli.py --gpus 4 --out \$OUT/dist_cli".
# Prints a short summary last. Logs and results go to $OUT (the device tool's output folder) or
# tools/results/: gpu_check.log, alloc_tests.xml, cuda_tests.xml, conformance.xml, bench_kernels.json,
# bench_summary.txt, alloc_build.log. Every stage has its own time limit (120 + 180 + 120 + 180 s at
# most; a typical full run is 5-7 minutes on an H100, --quick about 3): give the call 600 s.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

QUICK=0 RUN_BENCH=1 CONFORMANCE=1 SANITIZE=0
BENCH_GPT2=${BENCH_GPT2:-0}
BENCH_DIST=${BENCH_DIST:-0}
for arg in "$@"; do
    case "$arg" in
        --quick) QUICK=1 ;;
        --no-bench) RUN_BENCH=0 ;;
        --no-conformance) CONFORMANCE=0 ;;
        --sanitize) SANITIZE=1 ;;
        --gpt2-bench) BENCH_GPT2=1 ;;
        --gpt2-bench-only) BENCH_GPT2=only ;;
        *) echo "usage: $0 [--quick] [--no-bench] [--no-conformance] [--sanitize] [--gpt2-bench|--gpt2-bench-only]" >&2
           exit 2 ;;
    esac
done

OUT=${OUT:-$ROOT/tools/results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# Multi-GPU hosts here must keep NVLink multicast off (see the device tool's KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec > >(tee "$OUT/gpu_check.log") 2>&1
T0=$SECONDS
stamp() { echo "== [$((SECONDS - T0)) s] $*"; }

stamp "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader || true
"$PY" -c 'import sys, numpy, cupy, torch; print("python", sys.version.split()[0], "numpy", numpy.__version__,
"cupy", cupy.__version__, "torch", torch.__version__, "gpus", cupy.cuda.runtime.getDeviceCount())'

stamp "workspace (no network)"
EXTRA=""
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/blutrain-wheels .whl/*.whl \
        && EXTRA=/tmp/blutrain-wheels
fi
SITE=/tmp/blutrain-site
rm -rf "$SITE"
SRCS=$("$PY" - "$SITE" <<'PYEOF'
"""Write a .dist-info per workspace member so importlib.metadata sees its entry points; print the
src folders to put on sys.path."""
import sys
import tomllib
from pathlib import Path

site = Path(sys.argv[1])
site.mkdir(parents=True, exist_ok=True)
srcs = []
for pp in sorted([*Path("packages").glob("*/pyproject.toml"), *Path("plugins").glob("*/pyproject.toml")]):
    project = tomllib.loads(pp.read_text())["project"]
    name, version = project["name"], project.get("version", "0")
    src = (pp.parent / "src").resolve()
    srcs.append(str(src))
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = []
    for group, entries in project.get("entry-points", {}).items():
        present = {}
        for key, value in entries.items():
            mod = value.split(":")[0].replace(".", "/")
            if (src / f"{mod}.py").exists() or (src / mod / "__init__.py").exists():
                present[key] = value
            else:
                print(f"   skipped entry point {name} [{group}] {key} = {value}: module not in the tree", file=sys.stderr)
        if present:
            lines += [f"[{group}]", *(f"{k} = {v}" for k, v in present.items()), ""]
    (info / "entry_points.txt").write_text("\n".join(lines))
print(":".join(srcs))
PYEOF
)
# blutrain-alloc's native core: build it in place of its source tree (best effort; skipped with --quick, and
# then its tests are left out and BluTrain runs on CuPy's pool, which keeps no peak and gives no
# out-of-memory report). Built with TESTS too: a fresh clone has it, and what runs here should be what users run.
ALLOC=""
if [[ $QUICK == 0 ]]; then
    if timeout -k 5 120 "$PY" -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/blutrain-alloc \
            packages/blutrain-alloc >"$OUT/alloc_build.log" 2>&1; then
        ALLOC=/tmp/blutrain-alloc
        echo "   built blutrain-alloc's native core"
    else
        echo "   could not build blutrain-alloc's native core (see alloc_build.log): its tests are left out"
    fi
fi
# Without the native core the cuda backend keeps CuPy's own memory pool (it would otherwise install
# blutrain-alloc's caching allocator on first use).
[[ -z $ALLOC ]] && export BLUTRAIN_CUDA_ALLOCATOR=cupy
export PYTHONPATH="$SITE:${ALLOC:+$ALLOC:}$SRCS${EXTRA:+:$EXTRA}${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'PYEOF'
import blutrain.tensor as bt
import blutrain_backend_cupy as plugin
from blutrain.tensor.plugins import plugin_infos
print("plugins:", ", ".join(f"{p.name} ({p.distribution})" for p in plugin_infos()))
print("cuda available:", plugin.is_available(), "devices:", plugin.cuda.device_count())
x = bt.randn(4, 8, device="cuda")
diff = float((x @ x.T).cpu().sub(x.cpu() @ x.cpu().T).abs().max().item())
print(f"smoke: randn on {x.device}, GEMM vs CPU max |diff| {diff:.2e}")
PYEOF

# GPT-2 beside PyTorch (tools/bench/gpt2.py). Its --time-limit comes from what is left of the call, so that
# it skips stages it could not finish and still ends with its table (its JSON is rewritten after each stage).
RC_GPT2_BENCH=skipped
gpt2_bench() {
    local left=$(( ${BENCH_GPT2_BUDGET:-590} - (SECONDS - T0) ))
    if (( left < 120 )); then
        echo "   GPT-2 benchmark skipped: ${left} s left of the call"
        return
    fi
    stamp "GPT-2 benchmark against PyTorch (tools/bench/gpt2.py; ${left} s left)"
    timeout -k 10 "$left" "$PY" tools/bench/gpt2.py --out "$OUT/bench_gpt2" --time-limit $((left - 90)) \
        ${BENCH_GPT2_ARGS:-}
    RC_GPT2_BENCH=$?
}
if [[ $BENCH_GPT2 == only ]]; then
    gpt2_bench
    echo "exit code: gpt2 bench $RC_GPT2_BENCH; $((SECONDS - T0)) s"
    [[ $RC_GPT2_BENCH == 0 ]]
    exit
fi

# The multi-GPU benchmark (tools/bench/dist.py): a failing or hanging configuration is a row, and its --budget,
# from what is left of the call, keeps the whole run inside it: configurations that would start later are
# skipped, one running is stopped 90 s past the budget, and 20 s remain for the table (JSON rewritten as it goes).
RC_DIST_BENCH=skipped
dist_bench() {
    local left=$(( ${BENCH_DIST_BUDGET:-590} - (SECONDS - T0) ))
    if (( left < 120 )); then
        echo "   distributed benchmark skipped: ${left} s left of the call"
        return
    fi
    stamp "distributed benchmark (tools/bench/dist.py; ${left} s left)"
    timeout -k 10 "$left" "$PY" tools/bench/dist.py --out "$OUT/bench_dist" --budget $((left - 110)) \
        ${BENCH_DIST_ARGS:-}
    RC_DIST_BENCH=$?
}
if [[ $BENCH_DIST == only ]]; then
    dist_bench
    echo "exit code: dist bench $RC_DIST_BENCH; $((SECONDS - T0)) s"
    [[ $RC_DIST_BENCH == 0 ]]
    exit
fi

RC_ALLOC_TESTS=skipped
if [[ -n $ALLOC && -z "${TESTS:-}" ]]; then
    # In a process of their own: a fault in the native core must not take the kernel tests' results with it
    # (faulthandler names the test that crashed).
    stamp "blutrain-alloc cuda tests (native core, own process)"
    timeout -k 10 120 "$PY" -X faulthandler -m pytest -m cuda -v -rfE -p no:cacheprovider \
        --junitxml="$OUT/alloc_tests.xml" packages/blutrain-alloc/tests 2>&1 | tail -n 60
    RC_ALLOC_TESTS=${PIPESTATUS[0]}
fi

stamp "cuda tests (pytest -m cuda)"
# TESTS is split as the shell would split it, quotes included (-k 'a or b' stays one argument)
eval "TEST_ARGS=(${TESTS:-packages plugins})"
timeout -k 10 170 "$PY" -X faulthandler -m pytest -m cuda -q -rfE -p no:cacheprovider --continue-on-collection-errors \
    --ignore=packages/blutrain-alloc/tests --junitxml="$OUT/cuda_tests.xml" "${TEST_ARGS[@]}" 2>&1 | tail -n 80
RC_TESTS=${PIPESTATUS[0]}

RC_CONF=skipped
if [[ $CONFORMANCE == 1 && -f packages/blutrain-kernels/src/blutrain/kernels/conformance/__init__.py ]]; then
    stamp "conformance suite on cuda"
    # CuPy compiles each (op, dtype) kernel on first use; xdist workers share its on-disk cache
    XDIST=$("$PY" -c 'import xdist' 2>/dev/null && echo "-n 8")
    timeout -k 10 $((QUICK ? 150 : 240)) "$PY" -m pytest --pyargs blutrain.kernels.conformance $XDIST \
        --blutrain-device=cuda -q -rfE -p no:cacheprovider --junitxml="$OUT/conformance.xml" 2>&1 | tail -n 60
    RC_CONF=${PIPESTATUS[0]}
fi

RC_GPT2=skipped
if [[ ${GPT2:-1} == 1 ]]; then
    stamp "GPT-2 124M on cuda (fp32) against the CPU in float64"
    timeout -k 10 150 "$PY" tools/check_gpt2_cuda.py --out "$OUT/gpt2_check.json" 2>&1 | tail -n 20
    RC_GPT2=${PIPESTATUS[0]}
    stamp "blutrain train --device cuda --preset gpt2-124m (loss must fall)"
    timeout -k 10 150 "$PY" -m blutrain.cli train --device cuda --preset gpt2-124m --batch-size 8 --seq-len 512 \
        --max-steps 40 --warmup-steps 5 --lr 6e-4 --eval-every 0 --out /tmp/gpt2-cuda-run 2>&1 | tail -n 12
    cp /tmp/gpt2-cuda-run/metrics.jsonl "$OUT/gpt2_train_metrics.jsonl" 2>/dev/null || true
fi

RC_BENCH=skipped
if [[ $RUN_BENCH == 1 ]]; then
    stamp "kernel benchmark"
    timeout -k 10 $((QUICK ? 100 : 170)) "$PY" tools/bench_kernels.py $([[ $QUICK == 1 ]] && echo --quick) \
        --out "$OUT/bench_kernels.json" --summary "$OUT/bench_summary.txt" ${BENCH:+$BENCH}
    RC_BENCH=$?
fi

RC_SAN=skipped
if [[ $SANITIZE == 1 ]]; then
    stamp "compute-sanitizer memcheck over the fused-kernel tests"
    # CuPy's memory pool hands out sub-ranges of large blocks, so an overrun inside a block would not
    # be seen by memcheck: the pool is turned off here (every allocation is its own cudaMalloc), and so is
    # BluTrain's caching allocator, for the same reason.
    BLUTRAIN_CUDA_ALLOCATOR=cupy timeout -k 10 240 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 99 --print-limit 20 \
        "$PY" -c 'import sys, cupy, pytest; cupy.cuda.set_allocator(None); sys.exit(pytest.main(sys.argv[1:]))' \
        -q -p no:cacheprovider -m cuda packages/blutrain-kernels/tests/test_cuda*.py \
        "plugins/blutrain-backend-cupy/tests/test_cuda_backend.py::test_gemm_into_multiplies_row_major_matrices_and_accumulates" \
        "plugins/blutrain-backend-cupy/tests/test_cuda_backend.py::test_linear_cross_entropy_matches_float64_on_the_cpu" \
        "plugins/blutrain-backend-cupy/tests/test_cuda_backend.py::test_gemm_into_adds_bias_and_addend_in_the_epilogue" \
        "plugins/blutrain-backend-cupy/tests/test_cuda_backend.py::test_linear_gelu_matches_float64_on_the_cpu" \
        "plugins/blutrain-backend-cupy/tests/test_cuda_backend.py::test_linear_add_matches_float64_on_the_cpu" \
        packages/blutrain-compiler/tests/test_fusion_cuda.py \
        2>&1 | tail -n 30
    RC_SAN=${PIPESTATUS[0]}
fi

RC_ALLOC=skipped
if [[ ${BENCH_ALLOC:-0} == 1 && -n $ALLOC ]]; then
    stamp "allocator benchmark (tools/bench_alloc.py)"
    timeout -k 10 240 "$PY" tools/bench_alloc.py --out "$OUT" 2>&1 | tail -n 20
    RC_ALLOC=${PIPESTATUS[0]}
    stamp "allocator benchmark, GPT-2 with expandable segments"
    timeout -k 10 150 "$PY" tools/bench_alloc.py --expandable --out "$OUT" 2>&1 | tail -n 8
    RC_EXP=${PIPESTATUS[0]}
    [[ $RC_ALLOC == 0 ]] && RC_ALLOC=$RC_EXP
fi

[[ $BENCH_GPT2 == 1 ]] && gpt2_bench
[[ $BENCH_DIST == 1 ]] && dist_bench

RC_THEN=skipped
if [[ -n ${THEN:-} ]]; then
    left=$(( ${THEN_BUDGET:-590} - (SECONDS - T0) ))
    stamp "THEN: $THEN (${left} s left)"
    timeout -k 10 "$left" bash -c "$THEN"
    RC_THEN=$?
fi

stamp "summary"
"$PY" - "$OUT" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out = Path(sys.argv[1])
for name in ("alloc_tests", "cuda_tests", "conformance"):
    f = out / f"{name}.xml"
    if not f.exists():
        print(f"{name:<12} no report (skipped, or killed by its time limit: see gpu_check.log)")
        continue
    s = ET.parse(f).getroot()
    s = s if s.tag == "testsuite" else s[0]
    n, fail, err, skip = (int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    print(f"{name:<12} {n - fail - err - skip} passed, {fail} failed, {err} errors, {skip} skipped")
    failed = [c for c in s.iter("testcase") if c.find("failure") is not None or c.find("error") is not None]
    for case in failed[:40]:
        print(f"   FAILED {case.get('classname')}::{case.get('name')}")
    if len(failed) > 40:
        print(f"   ... and {len(failed) - 40} more (see the log)")
PYEOF
echo "exit codes: alloc tests $RC_ALLOC_TESTS, cuda tests $RC_TESTS, conformance $RC_CONF, sanitizer $RC_SAN, gpt2 check $RC_GPT2, benchmark $RC_BENCH, alloc $RC_ALLOC, gpt2 bench $RC_GPT2_BENCH, dist bench $RC_DIST_BENCH, then $RC_THEN; $((SECONDS - T0)) s"
if [[ -f "$OUT/bench_summary.txt" ]]; then
    echo
    cat "$OUT/bench_summary.txt"
fi
[[ $RC_TESTS == 0 && $RC_ALLOC_TESTS != [1-9]* ]]
