#!/usr/bin/env bash
# One prepared GPU check (issue 12, item 3), for a session that has a CUDA machine: at most ~8 minutes.
#   1. the CUDA tests (pytest -m cuda; they skip, with the reason, where there is no GPU), among them torch's CUDA
#      int4 kernel against the dequantized products of every GGUF type, fused CUDA stages against CPU ones,
#      seeded sampled generations on cuda (with guesses) and the sessions' budget from the device's free memory;
#   2. a 3-stage fleet of the small made Qwen3.5-MoE in GGUF Q4_K on cuda: the int4 kernel across a real chain;
#   3. a 3-stage fleet (16/16/16 layers) of a made Qwen3.5-MoE (qwen3_5_moe/mid: hidden 2048, 48 layers, 128 experts
#      top-8, narrow experts; bfloat16 safetensors; set GGUF=Q4_K to make and run the Q4_K file too, through the
#      CUDA int4 kernel, which adds the quantizer's minutes)
#      on --device cuda, printing per-trip compute / queue / network beside the reference report's 14.3 / 0.3 / 6.2 ms.
# Nothing here has run on a GPU yet (written in a session without one).
# Usage: bash benchmarks/gpu_check.sh [WORKDIR]   (from the repository root, with the venv active)
set -u -o pipefail
WORK=${1:-$(mktemp -d /tmp/sangama-gpu-check-XXXX)}
mkdir -p "$WORK"
export PYTHONPATH=${PYTHONPATH:-$PWD/src}
python - <<'PY' || { echo "gpu_check: no torch, or no CUDA device visible to it; nothing to check"; exit 1; }
import torch, sys
ok = torch.cuda.is_available()
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if ok else "")
sys.exit(0 if ok else 1)
PY

echo "== 1. CUDA tests"
timeout 150 python -m pytest -m cuda -q -rs tests/model/test_device.py tests/gguf/test_quants.py \
    tests/gguf/test_packed.py tests/gguf/test_fused_stage.py 2>&1 | tail -15

run_fleet() {  # $1: model path, $2: label, $3: timeout s
    echo "== $2: 3 stages on cuda, 1 request, 0 guesses, 32 tokens (tokens against one process on cuda)"
    timeout "$3" python -m sangama_p2p.cli.main demo --model "$1" --device cuda --tokens 32 --requests 1 \
        --guesses 0 --threads 4 --workdir "$WORK/demo-$2" --json "$WORK/$2.json" 2>&1 | tail -40
    python - "$WORK/$2.json" <<'PY'
import json, sys
try:
    doc = json.load(open(sys.argv[1]))
except (OSError, ValueError) as exc:
    sys.exit(f"no results ({exc})")
where = doc.get("where_the_time_goes") or doc.get("qwen3_5_moe", {}).get("where_the_time_goes")
print(json.dumps(doc.get("guesses"), indent=1)[:800])
print(json.dumps(where, indent=1)[:3000])
print("reference report (per trip): compute 14.3 ms / queue 0.3 ms / network 6.2 ms")
PY
}

echo "== 2. the CUDA int4 kernel through a fleet: qwen3_5_moe/small in GGUF Q4_K (50 s to make on 2 cores)"
timeout 120 python -m sangama_p2p.cli.main make-model "$WORK/qwen-small" --arch qwen3_5_moe --preset small \
    --gguf Q4_K >/dev/null && run_fleet "$WORK/qwen-small/model-Q4_K.gguf" small-Q4_K 120 \
    || echo "small Q4_K: make-model or the fleet failed or ran over its time"

echo "== 3. make qwen3_5_moe/mid (bfloat16)"
t0=$(date +%s)
timeout 200 python -m sangama_p2p.cli.main make-model "$WORK/qwen-mid" --arch qwen3_5_moe --preset mid \
    --dtype bfloat16 ${GGUF:+--gguf $GGUF} || { echo "make-model failed or took over 200 s"; exit 1; }
echo "made in $(( $(date +%s) - t0 )) s: $(du -sh "$WORK/qwen-mid" | cut -f1)"

run_fleet "$WORK/qwen-mid" mid-bf16 240
if [ -n "${GGUF:-}" ]; then run_fleet "$WORK/qwen-mid/model-$GGUF.gguf" "mid-$GGUF" 240; fi
echo "gpu_check: done (workdir $WORK)"
