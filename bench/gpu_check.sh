#!/usr/bin/env bash
# Prove the CUDA path on one NVIDIA GPU with no internet, in one device call; or the same check on the CPU.
#
#   bench/gpu_check.sh --prepare   # here, with PyPI: megatron-core/omegaconf/submitit wheels for cp312 into
#                                  # build/gpu_wheels (ignored by git; the device tool carries it). ~3 MB, ~2 s.
#   bench/gpu_check.sh             # on the GPU: install the wheels, bench/gpu_check.py, unit tests
#   bench/gpu_check.sh --rehearse  # here: the device call on the CPU (see below); CI runs it (tests/test_gpu_check.py)
#   bench/gpu_check.sh --dry-run   # CPU, this environment: bench/gpu_check.py's dry mode and the test selection
#
# The device call, after --prepare here (README, "On a GPU"):
#   run(command="bash bench/gpu_check.sh", carry=["build/gpu_wheels"], timeout_s=510)
# The inner limits add up to 445 s (install 30 + its check 30, check 270 + 10, tests 100 + 5), 65 s under
# timeout_s; the figures come back in $OUT/gpu_check.json.
#
# What runs there is the checkout itself (first on PYTHONPATH): the project is not installed, so the presets and
# configs are the checkout's files. Only what the GPU image lacks travels as wheels (DEPS); torch, numpy,
# transformers and the rest are the image's. --rehearse does the same here: a fresh venv holding only the image's
# packages (bench/gpu_image.py), `pip install --no-index` from the carried wheels alone, the network refused (a
# network namespace with loopback only; proxies to a closed port where none can be made), then the check's CPU
# mode and the collection of every selected unit test. A packaging mistake fails there first.
#
# GPU mode steps: 1. pip install --no-index --no-deps --target the carried wheels, and an install check that
# imports what the check needs and loads a preset by name; 2. bench/gpu_check.py: ~1.2B Llama in bf16, training
# MFU, generation vs transformers, GRPO steps, KV-cache log-prob checks, then a 2-rank TP=2 job over gloo with
# CUDA tensors staged through CPU buffers (parallel.backend=gloo) against NCCL or, on one GPU, the CPU (run before
# the tests so that they cannot starve it); 3. the in-process unit tests (GPU_TESTS below; the multi-process tests
# start CPU/gloo ranks and are left to CI). The last stdout line is one JSON object with every figure, the test
# outcome merged in; it is also $OUT/gpu_check.json. Logs go to $OUT (default ./gpu_check_out): nvidia-smi.txt,
# install.log, gpu_check.log, pytest.log, pytest.xml, gpu_check.json.
# Exit code: 0 when install, tests and every check passed.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

MODE=gpu
case "${1:-}" in
  "") ;;
  --dry-run) MODE=dry ;;
  --prepare) MODE=prepare ;;
  --rehearse) MODE=rehearse ;;
  *) echo "usage: bench/gpu_check.sh [--prepare | --rehearse | --dry-run]" >&2; exit 2 ;;
esac

WHEELS=${GPU_CHECK_WHEELS:-build/gpu_wheels}
SITE=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
# What the GPU image lacks, at the versions the project's environment pins (constraints/cpu.txt).
DEPS="megatron-core==0.19.2 omegaconf==2.4.0 submitit==1.5.4"
# Time limits (s) of the GPU mode's steps; with 65 s spare they make the device call's timeout_s (510).
INSTALL_LIMIT=30 CHECK_LIMIT=270 TESTS_LIMIT=100
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

dev_python() {  # the README's venv where there is one
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; elif [ -x .venv/bin/python ]; then echo .venv/bin/python; else echo python3; fi
}

if [ "$MODE" = prepare ]; then
  PY=$(dev_python)
  set -e
  rm -rf "$WHEELS"; mkdir -p "$WHEELS"
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$WHEELS" $DEPS
  ls -la "$WHEELS"; du -sh "$WHEELS"
  exit 0
fi

if [ "$MODE" = rehearse ] && [ -z "${GPU_CHECK_REHEARSING:-}" ]; then
  # Outside: carried files, the image's venv, then this script again inside a namespace without network.
  PY=$(dev_python)
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    PYTHON="$PY" bash "$0" --prepare >/dev/null || { echo "gpu_check.sh --rehearse: --prepare failed" >&2; exit 1; }
  fi
  venv=${GPU_CHECK_IMAGE_VENV:-$(mktemp -d /tmp/gpu_check_image.XXXXXX)}
  image_python=$("$PY" bench/gpu_image.py "$venv") || exit 1
  site=$(mktemp -d /tmp/gpu_check_site.XXXXXX)
  inner=(env GPU_CHECK_REHEARSING=1 PYTHON="$image_python" GPU_CHECK_SITE="$site" bash "$0" --rehearse)
  if unshare -rn true 2>/dev/null; then
    network="refused (network namespace, loopback only)"
    GPU_CHECK_NETWORK="$network" unshare -rn sh -c 'ip link set lo up 2>/dev/null || true; exec "$@"' sh "${inner[@]}"
  else
    network="refused (proxies to a closed port; no network namespace here)"
    GPU_CHECK_NETWORK="$network" PIP_NO_INDEX=1 http_proxy=http://127.0.0.1:9 https_proxy=http://127.0.0.1:9 \
      HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9 "${inner[@]}"
  fi
  rc=$?
  rm -rf "$site"; [ -n "${GPU_CHECK_IMAGE_VENV:-}" ] || rm -rf "$venv"
  exit $rc
fi

OUT=${OUT:-./gpu_check_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
started=$SECONDS

# Adds the unit-test outcome to $OUT/gpu_check.json and prints the one JSON line (last line of stdout).
merge_and_print() {  # RC SUMMARY
  "$PYTHON" - "$OUT/gpu_check.json" "$1" "$2" "$((SECONDS - started))" "$MODE" "${GPU_CHECK_NETWORK:-}" <<'PY'
import json, os, sys
path, rc, summary, total_s, mode, network = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), *sys.argv[5:7]
result = json.load(open(path)) if os.path.exists(path) else {
    "error": "bench/gpu_check.py wrote no JSON (see gpu_check.log)", "checks": {}, "passed": False}
result["unit_tests"] = {"rc": rc, "summary": summary}
result.setdefault("checks", {})["unit_tests"] = rc == 0
if mode == "rehearse":
    result["rehearsal"] = {"network": network, "python": sys.executable}
result["passed"] = bool(result.get("passed")) and rc == 0
result["script_wall_s"] = total_s
line = json.dumps(result)
open(path, "w").write(line + "\n")
print(line)
sys.exit(0 if result["passed"] else 1)
PY
}

if [ "$MODE" = dry ]; then
  PYTHON=$(dev_python)
  export CUDA_VISIBLE_DEVICES=""
  timeout -k 10 170 "$PYTHON" bench/gpu_check.py --dry-run --out "$OUT" --install-summary "skipped (dry run)" \
    >"$OUT/gpu_check.log" 2>&1
  # CI runs the tests themselves; here only check that step 3's selection still names real files and tests.
  tests_rc=0; missing=""
  for item in "${GPU_TESTS[@]}"; do
    case "$item" in
      *::*) grep -q "^def ${item#*::}(" "${item%%::*}" 2>/dev/null || { tests_rc=1; missing="$missing $item"; } ;;
      *) [ -f "$item" ] || { tests_rc=1; missing="$missing $item"; } ;;
    esac
  done
  merge_and_print "$tests_rc" "selection checked, not run (dry run)${missing:+; missing:$missing}"
  rc=$?
  echo "[gpu_check.sh] dry run done in $((SECONDS - started)) s, exit $rc" >&2
  exit $rc
fi

# GPU mode, and the rehearsal's inner run (the image's venv, no network, CPU)
PYTHON=${PYTHON:-python3}
case "$PYTHON" in */*) PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")" ;; esac
CHECK_ARGS=()
if [ "$MODE" = rehearse ]; then
  export CUDA_VISIBLE_DEVICES=""
  CHECK_ARGS=(--dry-run)
  case "${GPU_CHECK_NETWORK:-}" in *namespace*)
    if "$PYTHON" -c "import socket; socket.create_connection(('pypi.org', 443), timeout=3)" 2>/dev/null; then
      echo "gpu_check.sh --rehearse: pypi.org is reachable inside the rehearsal's network namespace" >&2; exit 1
    fi ;;
  esac
else
  nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true
fi

# 1. install the carried wheels (no index, no dependency resolution: torch stays the machine's own); the checkout
# itself goes first on the path, with its presets and configs
t0=$SECONDS
rm -rf "$SITE"
if ls "$WHEELS"/*.whl >/dev/null 2>&1 && timeout "$INSTALL_LIMIT" "$PYTHON" -m pip install -q --no-index --no-deps \
    --disable-pip-version-check --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl >"$OUT/install.log" 2>&1; then
  install_rc=0
else
  echo "no wheels in $WHEELS or pip failed: run bench/gpu_check.sh --prepare here and carry $WHEELS" \
    >>"$OUT/install.log"
  install_rc=1
fi
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
# What the check imports, from where, and a preset and a recipe loaded by name.
(cd /tmp && timeout "$INSTALL_LIMIT" "$PYTHON" "$REPO/bench/gpu_install_check.py" "$REPO") >>"$OUT/install.log" 2>&1 || install_rc=1
install_summary="rc $install_rc in $((SECONDS - t0)) s: $(cd "$WHEELS" 2>/dev/null && echo *.whl); $(tail -n 1 "$OUT/install.log")"
echo "[gpu_check.sh] install: $install_summary" >&2

# 2. the check itself (first, so that slow tests cannot starve it); it writes $OUT/gpu_check.json
t0=$SECONDS
timeout -k 10 "$CHECK_LIMIT" "$PYTHON" bench/gpu_check.py "${CHECK_ARGS[@]}" --out "$OUT" \
  --install-summary "$install_summary" --install-rc "$install_rc" >"$OUT/gpu_check.log" 2>&1
echo "[gpu_check.sh] bench/gpu_check.py: exit $? in $((SECONDS - t0)) s" >&2

# 3. unit tests that run in one process (on the GPU: CUDA visible, so the CPU redirection stays off); the rehearsal
# collects them (every module imports with the image's packages; CI runs them)
t0=$SECONDS
PYTEST=(-m pytest -q -p no:cacheprovider --junitxml="$OUT/pytest.xml")
[ "$MODE" = rehearse ] && PYTEST+=(--collect-only)
timeout -k 5 "$TESTS_LIMIT" "$PYTHON" "${PYTEST[@]}" "${GPU_TESTS[@]}" >"$OUT/pytest.log" 2>&1
tests_rc=$?
tests_summary="$(tail -n 1 "$OUT/pytest.log") ($((SECONDS - t0)) s)"
echo "[gpu_check.sh] unit tests: rc $tests_rc: $tests_summary" >&2

grep -E "^\[gpu_check|Error|error" "$OUT/gpu_check.log" | tail -n 20 >&2
merge_and_print "$tests_rc" "$tests_summary"
rc=$?
echo "[gpu_check.sh] done in $((SECONDS - started)) s, exit $rc" >&2
exit $rc
