#!/usr/bin/env bash
# The GPU check (issue 19): on one CUDA device, profile a small Hugging Face Llama, solve for one
# device, run the plan, print predicted vs measured step time and peak memory, and run the tests
# marked `cuda`. About 4 minutes on one GPU; every part has a time limit, 8 minutes in all. No network needed: pulp and highspy come from
# .wheels/ when missing.
#
#   scripts/gpu_check.sh [OUT_DIR]        (default gpu-check-out/)
#
# Every part runs even if an earlier one failed; the script exits non-zero if any part failed.
# OUT_DIR gets each part's log, the profile, plans, reports (JSON) and summary.txt.
set -u
cd "$(dirname "$0")/.."
OUT="${1:-gpu-check-out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
FAILED=()
START=$(date +%s)
BUDGET_S="${GPU_CHECK_BUDGET_S:-470}"
: >"$OUT/summary.txt"
# GPU_CHECK_DEVICE=cpu GPU_CHECK_SMALL=1: the same parts on the CPU with a tiny model (to test this script)
DEVICE="${GPU_CHECK_DEVICE:-cuda}"

part() {  # part NAME TIMEOUT_S COMMAND...: run, log to OUT/NAME.log, record a failure
    local name="$1" limit="$2"
    shift 2
    echo "== $name" | tee -a "$OUT/summary.txt"
    local left=$(( BUDGET_S - ($(date +%s) - START) ))  # the whole check stays under 8 minutes
    if [ "$left" -lt 10 ]; then
        echo "   $name: not run, the check's $BUDGET_S s are spent" | tee -a "$OUT/summary.txt"
        FAILED+=("$name")
        return
    fi
    if [ "$limit" -gt "$left" ]; then limit=$left; fi
    local t0=$(date +%s)
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.log"
    echo "   $name: exit $rc in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
    if [ "$rc" -ne 0 ]; then FAILED+=("$name"); fi
}

# --- 0. the environment -------------------------------------------------------------------------
if ! "$PY" -c "import pulp, highspy" 2>/dev/null; then
    if [ -d .wheels ]; then
        "$PY" -m pip install --no-index --find-links .wheels pulp highspy >"$OUT/pip.log" 2>&1 \
            || echo "warning: installing pulp/highspy from .wheels failed (see $OUT/pip.log)"
    else
        echo "warning: pulp/highspy missing and no .wheels/ folder: the solve will fail"
    fi
fi
part environment 30 "$PY" -c "
import json, torch, sys
info = {'python': sys.version.split()[0], 'torch': torch.__version__, 'cuda': torch.version.cuda,
        'available': torch.cuda.is_available(),
        'device': torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        'memory_bytes': torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None,
        'nccl': '.'.join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None}
try:
    import transformers; info['transformers'] = transformers.__version__
except Exception as e:
    info['transformers'] = repr(e)
json.dump(info, open('$OUT/environment.json', 'w'), indent=1)
print(json.dumps(info))
assert info['available'] or '$DEVICE' == 'cpu', 'no CUDA device'
"

# --- 1. profile a small Llama on cuda -----------------------------------------------------------
LLAMA=(hf:LlamaForCausalLM --model-arg num_hidden_layers=8 --model-arg hidden_size=1024
       --model-arg intermediate_size=2816 --model-arg num_attention_heads=16 --model-arg num_key_value_heads=4
       --model-arg vocab_size=32000 --model-arg seq_len=512)
if [ -n "${GPU_CHECK_SMALL:-}" ]; then
    LLAMA=(hf:LlamaForCausalLM --model-arg num_hidden_layers=2 --model-arg hidden_size=128
           --model-arg intermediate_size=256 --model-arg num_attention_heads=4 --model-arg num_key_value_heads=2
           --model-arg vocab_size=1000 --model-arg seq_len=64)
fi
part profile 120 "$PY" -m planner.cli profile "${LLAMA[@]}" --device "$DEVICE" --micro-batch-sizes 1,2,4 \
    --repeats 5 --min-time 0.5 --warmup 1 --link none --output "$OUT/profile.json"

# --- 2. solve for one device and run it -----------------------------------------------------------
part solve 30 "$PY" -m planner.cli solve "$OUT/profile.json" --stages 1 --global-batch 16 \
    --output "$OUT/plan.json"
part execute 75 "$PY" -m runtime.cli execute "$OUT/plan.json" --steps 12 --report "$OUT/report.json" \
    --timeout 60
# planned and run at precision bf16-mixed (one bf16 copy of the weights per step, fp32 masters)
part solve-bf16 30 "$PY" -m planner.cli solve "$OUT/profile.json" --stages 1 --global-batch 16 \
    --precision bf16-mixed --output "$OUT/plan-bf16.json"
part execute-bf16 75 "$PY" -m runtime.cli execute "$OUT/plan-bf16.json" --steps 12 \
    --report "$OUT/report-bf16.json" --timeout 60
# two stages on the one GPU (interleaved, v = 2: handed over in memory): the multi-stage engine on CUDA
part solve-2stages 30 "$PY" -m planner.cli solve "$OUT/profile.json" --stages 1 --schedule interleaved \
    --virtual-stages 2 --global-batch 16 --output "$OUT/plan-2stages.json"
part execute-2stages 75 "$PY" -m runtime.cli execute "$OUT/plan-2stages.json" --steps 8 \
    --report "$OUT/report-2stages.json" --timeout 60

# --- 3. predicted vs measured ------------------------------------------------------------------------
part compare 20 "$PY" - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
rows = []
for name in ("report.json", "report-bf16.json", "report-2stages.json"):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        continue
    r = json.load(open(path))
    for s in r["stages"]:
        rows.append({"report": name, "rank": s["rank"], "predicted_step_ms": r["predicted_iteration_s"] * 1e3,
                     "measured_step_ms": r["measured_iteration_s"] * 1e3,
                     "error_pct": (r["relative_error"] or 0) * 100,
                     "forward_ms": [s["measured"]["forward_s"] * 1e3, s["predicted"]["forward_s"] * 1e3],
                     "backward_ms": [s["measured"]["backward_s"] * 1e3, s["predicted"]["backward_s"] * 1e3],
                     "peak_memory_mib": (s.get("peak_memory_bytes") or 0) / 2**20,
                     "planned_memory_mib": (s.get("predicted_memory_bytes") or 0) / 2**20,
                     "held_for_backward_mib": [(s.get("peak_saved_bytes") or 0) / 2**20,
                                               s.get("predicted_activation_bytes", 0) / 2**20]})
json.dump(rows, open(os.path.join(out, "compare.json"), "w"), indent=1)
for row in rows:
    print(f"{row['report']}: step predicted {row['predicted_step_ms']:.2f} ms, measured {row['measured_step_ms']:.2f} ms "
          f"({row['error_pct']:+.1f} %); forward {row['forward_ms'][0]:.2f}/{row['forward_ms'][1]:.2f} ms, backward "
          f"{row['backward_ms'][0]:.2f}/{row['backward_ms'][1]:.2f} ms (measured/predicted); peak memory "
          f"{row['peak_memory_mib']:.1f} MiB (allocator) vs planned {row['planned_memory_mib']:.1f} MiB; held for "
          f"backward {row['held_for_backward_mib'][0]:.1f}/{row['held_for_backward_mib'][1]:.1f} MiB")
assert rows, "no report to compare"
EOF

# --- 4. the tests that need CUDA ------------------------------------------------------------------------
# (only the files holding them: collecting the whole suite costs time and imports every test module)
mapfile -t CUDA_TESTS < <(grep -rl --include='test_*.py' 'mark.cuda' tests | sort)
part cuda-tests 170 "$PY" -m pytest -q -rs -m cuda -p no:cacheprovider --junitxml "$OUT/cuda-tests.xml" \
    "${CUDA_TESTS[@]}"

echo "== total $(( $(date +%s) - START )) s" | tee -a "$OUT/summary.txt"
if [ "${#FAILED[@]}" -ne 0 ]; then
    echo "FAILED: ${FAILED[*]}" | tee -a "$OUT/summary.txt"
    exit 1
fi
echo "all parts passed" | tee -a "$OUT/summary.txt"
