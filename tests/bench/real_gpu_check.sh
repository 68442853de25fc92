#!/bin/bash
# dvfs on a real NVIDIA GPU, read-only: safe on a shared GPU (no clock, power limit,
# persistence or compute-mode change; every NVML setter refuses and is logged, see
# setter_guard/). Needs dvfs's dependencies and torch; no SGLang, no model.
#
#   tests/bench/real_gpu_check.sh OUT [STEP...]     (steps: all by default)
#
# Steps: contract (NVML contract tests on the real library), cli (gpu list/info, cap show,
# monitor --once), probe (NVML's traps, tests/bench/nvml_probe.py), sweeps (= alone shared:
# observe-only
# sweeps with the SGLang stub loading GPU 0 through torch: alone, its pinning verified; then
# beside another tenant's GEMMs, every cell flagged foreign_process, and idle_baseline_foreign
# as the opening idle measurement ran beside them too), roofline (observe-only
# roofline and its twin fit). Each step's output is OUT/STEP*.out; OUT/steps.txt sums up, and
# the run fails if a setter was called or a GPU setting reads differently afterwards.
set -u
OUT=${1:?usage: real_gpu_check.sh OUT [STEP...]}
shift
STEPS=${*:-contract cli probe sweeps roofline}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd) || exit 1
DEVICE=${DVFS_CHECK_DEVICE:-cuda}  # the torch device of the loads (cpu: a dry run on the fake)
export DEVICE
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT/tests/bench/setter_guard:$ROOT:${PYTHONPATH:-}
export DVFS_GUARD_LOG=$OUT/setter-guard.log DVFS_STATE_DIR=$OUT/state
PY=${PYTHON:-python3}
Q=persistence_mode,compute_mode,power.limit,enforced.power.limit,clocks.applications.graphics,mig.mode.current
nvidia-smi --query-gpu=$Q --format=csv > "$OUT/settings-before.csv"
$PY -c 'import pynvml; assert pynvml.DVFS_SETTERS_GUARDED > 0' || exit 1

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    local start; start=$(date +%s%N)
    timeout "$limit" "$@" > "$OUT/$name.out" 2>&1
    local rc=$? end; end=$(date +%s%N)
    printf '%-12s rc=%-3s %6s ms\n' "$name" "$rc" $(((end - start) / 1000000)) | tee -a "$OUT/steps.txt"
}

campaign() {  # campaign DIR: the stub as the server, loading GPU 0; GPU 0 metered observe-only
    $PY - "$1" <<'EOF'
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd() / "tests"))
from sglang_support import stub_campaign

folder = Path(sys.argv[1])
folder.mkdir(parents=True, exist_ok=True)
path, _ = stub_campaign(
    folder,
    gpu='backend = "nvml"\ndevices = [0]\nactuation = "off"',
    knobs='sm_clock = "stock"',
    batch="[1, 8]",
    output_tokens=300,
    warmup_tokens=8,
    stub={"tpot_s": 0.01, "ttft_s": 0.05, "startup_s": 0.5,
          "torch_load_device": os.environ["DEVICE"]},
)
text = path.read_text()
for old, new in (("max_rounds = 1", "max_rounds = 3"), ("idle_s = 0.0", "idle_s = 1.0"),
                 ("min_window_s = 0.05", "min_window_s = 1.0")):
    text = text.replace(old, new)
path.write_text(text)
print(path)
EOF
}

BURN='import os, sys, time, torch
a = torch.randn(8192, 8192, device=os.environ["DEVICE"])
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    a @ a
    if a.is_cuda:
        torch.cuda.synchronize()'

cd "$ROOT" || exit 1
for s in $STEPS; do
    case $s in
    contract) step contract 300 $PY -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_nvml_contract.py ;;
    cli)
        step gpu-list 60 $PY -m dvfs gpu list
        step gpu-info 60 $PY -m dvfs gpu info 0 --json
        step cap-show 60 $PY -m dvfs cap show
        step monitor 60 $PY -m dvfs monitor --once --gpu 0 ;;
    probe) step probe 120 $PY tests/bench/nvml_probe.py --gpu 0 --out "$OUT/probe.json" --after-s 10 ;;
    sweeps | alone)
        alone=$(campaign "$OUT/alone")
        step doctor 120 $PY -m dvfs doctor "$alone" -o "$OUT/alone/sweep"
        step sweep-alone 300 $PY -m dvfs sweep "$alone" --out "$OUT/alone/sweep" --no-progress
        step info-alone 60 $PY -m dvfs cube info "$OUT/alone/sweep" ;;&
    sweeps | shared)
        shared=$(campaign "$OUT/shared")
        $PY -c "$BURN" 300 & burner=$!
        sleep 5  # its CUDA context is up and its GEMMs run
        step sweep-shared 300 $PY -m dvfs sweep "$shared" --out "$OUT/shared/sweep" --no-progress
        kill $burner; wait $burner 2> /dev/null
        step info-shared 60 $PY -m dvfs cube info "$OUT/shared/sweep" ;;
    roofline)
        step roofline 300 $PY -m dvfs gpu roofline --observe-only --json -o "$OUT/roofline.nc"
        step twin-fit 60 $PY -m dvfs twin fit "$OUT/roofline.nc" -o "$OUT/twin-fit.toml" ;;
    sweeps | alone | shared) ;;
    *) echo "unknown step $s" >&2; exit 2 ;;
    esac
done

nvidia-smi --query-gpu=$Q --format=csv > "$OUT/settings-after.csv"
status=0
if [ -s "$OUT/setter-guard.log" ]; then
    echo "NVML setters were called:"; cat "$OUT/setter-guard.log"; status=1
fi
if ! diff "$OUT/settings-before.csv" "$OUT/settings-after.csv"; then
    echo "GPU settings changed"; status=1
fi
[ $status -eq 0 ] && echo "no setter called; GPU settings unchanged"
exit $status
