#!/usr/bin/env bash
# Prove the CUDA path on one NVIDIA GPU with no internet, in under 8 minutes; or the same check on the CPU.
#
#   bench/gpu_check.sh --prepare   # here, with PyPI: our wheel + megatron-core/omegaconf/submitit for cp312
#                                  # into build/gpu_wheels (ignored by git; the device tool carries it)
#   bench/gpu_check.sh             # on the GPU: install the wheels, unit tests, bench/gpu_check.py
#   bench/gpu_check.sh --dry-run   # CPU, tiny model, fp32: the same Python path (tests/test_gpu_check.py)
#
# With this workplace's device tool, after --prepare here: run(command="bash bench/gpu_check.sh",
# carry=["build/gpu_wheels"], timeout_s=480); the figures come back in $OUT/gpu_check.json.
#
# GPU mode steps: 1. pip install --no-index --no-deps --target the carried wheels (torch, numpy, transformers
# come from the machine); 3-5. bench/gpu_check.py: ~1.2B Llama in bf16, training MFU, generation vs
# transformers, GRPO steps, KV-cache log-prob checks, then a 2-rank TP=2 job over gloo with CUDA tensors staged
# through CPU buffers (parallel.backend=gloo) against NCCL (run before the tests so that they cannot starve it);
# 2. the in-process unit tests (GPU_TESTS below; the multi-process tests start CPU/gloo ranks and are left to
# CI). The last stdout line is one JSON object with every figure, the test outcome merged in; it is also
# $OUT/gpu_check.json. Logs go to $OUT (default ./gpu_check_out): nvidia-smi.txt, install.log, gpu_check.log,
# pytest.log, pytest.xml, gpu_check.json. Time limits: install 90 s, check 270 s, tests 100 s (< 8 min).
# Exit code: 0 when install, tests and every check passed.
set -uo pipefail
cd "$(dirname "$0")/.."

MODE=gpu
case "${1:-}" in
  "") ;;
  --dry-run) MODE=dry ;;
  --prepare) MODE=prepare ;;
  *) echo "usage: bench/gpu_check.sh [--dry-run | --prepare]" >&2; exit 2 ;;
esac

WHEELS=${GPU_CHECK_WHEELS:-build/gpu_wheels}
SITE=/tmp/gpu_check_site
# Pure-Python or cp312 wheels the GPU image lacks; versions match the project's environment.
DEPS="megatron-core==0.19.2 omegaconf==2.4.0 submitit==1.5.4"
G=tests/test_generation.py
GPU_TESTS=(
  tests/test_grpo_math.py tests/test_planner.py tests/test_planner_megatron_rules.py
  tests/test_planner_calibration.py tests/test_config.py tests/test_model_shape.py tests/test_rewards.py
  tests/test_prompt_data.py
  "$G::test_sampling_frequencies_follow_the_tempered_softmax" "$G::test_top_k_keeps_the_k_most_likely_tokens"
  "$G::test_top_p_keeps_the_smallest_set_reaching_p"
  "$G::test_top_k_1_and_temperature_0_are_greedy_and_never_pick_padded_rows"
  "$G::test_policy_logprobs_use_raw_logits_over_the_padded_vocabulary"
  "$G::test_same_generator_state_gives_the_same_tokens" "$G::test_sampling_params_are_checked"
  "$G::test_host_offload_frees_storage_and_restores_values_and_views_exactly" tests/test_paged_engine.py
)

if [ "$MODE" = prepare ]; then
  PY=${PYTHON:-.venv/bin/python}
  set -e
  rm -rf "$WHEELS"; mkdir -p "$WHEELS"
  src=$(mktemp -d)
  cp -r pyproject.toml launcher megatron_rl "$src"/
  [ -f README.md ] && cp README.md "$src"/
  find "$src" -name __pycache__ -prune -exec rm -rf {} +
  "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" "$src"
  rm -rf "$src"
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHEELS" $DEPS
  ls -la "$WHEELS"; du -sh "$WHEELS"
  exit 0
fi

OUT=${OUT:-./gpu_check_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
started=$SECONDS

# Adds the unit-test outcome to $OUT/gpu_check.json and prints the one JSON line (last line of stdout).
merge_and_print() {  # RC SUMMARY
  "$PYTHON" - "$OUT/gpu_check.json" "$1" "$2" "$((SECONDS - started))" <<'PY'
import json, os, sys
path, rc, summary, total_s = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
result = json.load(open(path)) if os.path.exists(path) else {
    "error": "bench/gpu_check.py wrote no JSON (see gpu_check.log)", "checks": {}, "passed": False}
result["unit_tests"] = {"rc": rc, "summary": summary}
result.setdefault("checks", {})["unit_tests"] = rc == 0
result["passed"] = bool(result.get("passed")) and rc == 0
result["script_wall_s"] = total_s
line = json.dumps(result)
open(path, "w").write(line + "\n")
print(line)
sys.exit(0 if result["passed"] else 1)
PY
}

if [ "$MODE" = dry ]; then
  if [ -z "${PYTHON:-}" ]; then PYTHON=python3; [ -x .venv/bin/python ] && PYTHON=.venv/bin/python; fi
  export CUDA_VISIBLE_DEVICES=""
  timeout -k 10 170 "$PYTHON" bench/gpu_check.py --dry-run --out "$OUT" --install-summary "skipped (dry run)" \
    >"$OUT/gpu_check.log" 2>&1
  # CI runs the tests themselves; here only check that step 2's selection still names real files and tests.
  tests_rc=0; missing=""
  for item in "${GPU_TESTS[@]}"; do
    case "$item" in
      --*) ;;
      *::*) grep -q "^def ${item#*::}(" "${item%%::*}" 2>/dev/null || { tests_rc=1; missing="$missing $item"; } ;;
      *) [ -f "$item" ] || { tests_rc=1; missing="$missing $item"; } ;;
    esac
  done
  merge_and_print "$tests_rc" "selection checked, not run (dry run)${missing:+; missing:$missing}"
  rc=$?
  echo "[gpu_check.sh] dry run done in $((SECONDS - started)) s, exit $rc" >&2
  exit $rc
fi

PYTHON=${PYTHON:-python3}
case "$PYTHON" in */*) PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")" ;; esac
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true

# 1. install the carried wheels (no index, no dependency resolution: torch stays the machine's own)
t0=$SECONDS
if ls "$WHEELS"/*.whl >/dev/null 2>&1 && timeout 90 "$PYTHON" -m pip install -q --no-index --no-deps \
    --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl >"$OUT/install.log" 2>&1; then
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  install_rc=0
else
  echo "no wheels in $WHEELS or pip failed: run bench/gpu_check.sh --prepare here and carry $WHEELS" \
    >>"$OUT/install.log"
  install_rc=1
fi
(cd /tmp && "$PYTHON" -c "import megatron.core, megatron_rl, omegaconf; print('imports from', megatron_rl.__file__)") \
  >>"$OUT/install.log" 2>&1 || install_rc=1
install_summary="rc $install_rc in $((SECONDS - t0)) s: $(cd "$WHEELS" 2>/dev/null && echo *.whl)"
echo "[gpu_check.sh] install: $install_summary" >&2

# 3-5. the check itself (first, so that slow tests cannot starve it); it writes $OUT/gpu_check.json
t0=$SECONDS
timeout -k 10 270 "$PYTHON" bench/gpu_check.py --out "$OUT" --install-summary "$install_summary" \
  --install-rc "$install_rc" >"$OUT/gpu_check.log" 2>&1
echo "[gpu_check.sh] bench/gpu_check.py: exit $? in $((SECONDS - t0)) s" >&2

# 2. unit tests that run in one process (CUDA visible, so the CPU redirection stays off)
t0=$SECONDS
timeout -k 5 100 "$PYTHON" -m pytest -q -p no:cacheprovider --junitxml="$OUT/pytest.xml" "${GPU_TESTS[@]}" \
  >"$OUT/pytest.log" 2>&1
tests_rc=$?
tests_summary="$(tail -n 1 "$OUT/pytest.log") ($((SECONDS - t0)) s)"
echo "[gpu_check.sh] unit tests: rc $tests_rc: $tests_summary" >&2

grep -E "^\[gpu_check|Error|error" "$OUT/gpu_check.log" | tail -n 20 >&2
merge_and_print "$tests_rc" "$tests_summary"
rc=$?
echo "[gpu_check.sh] done in $((SECONDS - started)) s, exit $rc" >&2
exit $rc
