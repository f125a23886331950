#!/usr/bin/env bash
# Every CUDA check of the worker, in one go, on a machine with an NVIDIA GPU.
# Prints the numbers that go into docs/benchmarks.md.
#
#   scripts/gpu-check.sh                 build a kit here (cargo, PyPI), run it
#   scripts/gpu-check.sh --kit DIR       run a kit built by scripts/gpu-kit.sh
#                                        (no Rust toolchain, no network needed)
#   scripts/gpu-check.sh --kit DIR --rehearse
#                                        the same without a GPU: checks the kit
#                                        and runs the CPU half (tests skip)
#   ... --only 4,5                       only these steps (1b 1c 2 3 4 5 6 7 8 9 10;
#                                        the kit check of step 1 always runs)
#
# Needs on the GPU machine: the NVIDIA driver (libcuda), NVRTC, and CUDA 13 +
# cuDNN 9 for ONNX Runtime's CUDA provider. They are looked for in
# /usr/local/cuda, in the nvidia-* Python packages of python3 (a PyTorch or
# onnxruntime-gpu install has them), and in TIDEGATE_CUDA_LIBS (extra
# folders, colon-separated).
#
# Steps: 1. what the machine has, the worker's check-cuda (provider, driver,
# devices, NVRTC), and a fast pre-check: the worker's check-config on CUDA, which loads every library the later steps load at
# run time (ONNX Runtime's CUDA provider, cuBLAS, cuDNN, NVRTC) and must
# report GPU preprocessing; 2. GPU tests with TIDEGATE_REQUIRE_GPU=1 (a skip
# is a failure): kernel == CPU preprocessing, CUDA detections == CPU within
# tolerance, an unusable device refused or served on the CPU; 3. benchmarks:
# worker vs raw ONNX Runtime per batch size, BlazeFace on the CPU (the
# baseline on this host), BlazeFace and (when in the kit) CenterNet on CUDA
# with u8 upload + GPU normalise vs f32 upload; 4. start-up: process start ->
# models warmed and profiled (check-config), CPU and CUDA; 5. cuDNN's
# convolution algorithm search (runtime.cuda.conv_algo_search): start-up of
# each model and CenterNet's throughput per mode, in the same run; 6. end to
# end: tidegate-loadtest --local (a gateway and one worker on 127.0.0.1, QUIC,
# the 80 ms budget) with the worker on CUDA, BlazeFace and CenterNet; it
# fails unless E2E_MIN_SLO (default 0.99) of the frames due are ok in budget;
# 7. the worker's /metrics on the GPU: NVML's utilisation, memory, power and
# temperature, which the dashboard's GPU panels read; 8. precision and
# TensorRT: each model's profile per batch size and its time to ready with
# FP32 on CUDA, the FP16 variant on CUDA, and TensorRT FP16 with a cold and
# then a warm engine cache (TensorRT's libraries must be on the library
# path: TIDEGATE_CUDA_LIBS, or python3's tensorrt_libs; without them the
# worker serves on CUDA alone and says why, and the step reports that);
# 9. the whole path at the GPU's speed: scripts/gpu-ramp.py ramps each
# model end to end to its highest rate within the SLO, with the gateway's
# CPU per 1,000 frames, against the worker's own best throughput; 10. the
# WAN case that waits for a GPU (make bench-wan's 20ms-2pct-bursty-centernet:
# CenterNet 4 x 5 fps through the impairment relay at 20 ms RTT and 2 %
# bursty loss, goal >= 95 % ok within 80 ms), the workers on the GPU.
#
# A failing step does not stop the others: each step's status is recorded,
# a summary closes the log, and the exit status is 1 if any step failed.
# Each step is bounded by STEP_TIMEOUT seconds (default 300) where
# `timeout` exists. Only a damaged kit stops the script at once.
# Output also goes to $OUT/gpu-check.log when OUT is set, else KIT/gpu-check.log.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
cd "$root"
say() { printf '\n\033[1mgpu-check:\033[0m %s\n' "$*"; }
die() { printf 'gpu-check: error: %s\n' "$*" >&2; exit 1; }
started=$(date +%s)

kit="" rehearse=0 only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --kit) kit="${2:?--kit needs a folder}"; shift 2 ;;
    --rehearse) rehearse=1; shift ;;
    --only) only=",$(tr -d ' ' <<<"${2:?--only needs steps, e.g. 4,5}"),"; shift 2 ;;
    *) die "unknown argument $1; see the header of scripts/gpu-check.sh" ;;
  esac
done
if [ -z "$kit" ]; then
  command -v nvidia-smi >/dev/null || die "nvidia-smi not found: no NVIDIA driver here"
  kit="$root/target/gpukit"
  bash "$here/gpu-kit.sh" "$kit" || die "building the kit failed (see above)"
fi
for n in $(tr ',' ' ' <<<"$only"); do
  case "$n" in 1b | 1c | 2 | 3 | 4 | 5 | 6 | 7 | 8 | 9 | 10) ;; *) die "--only: no step $n (steps: 1b 1c 2 3 4 5 6 7 8 9 10)" ;; esac
done
# want N: whether step N runs.
want() { [ -z "$only" ] || [[ "$only" == *",$1,"* ]]; }
kit="$(cd "$kit" && pwd)" || die "no kit folder $kit"
log="${OUT:-$kit}/gpu-check.log"
exec > >(tee "$log") 2>&1

# step NAME CMD...: runs CMD, records its status. A program is bounded by
# STEP_TIMEOUT; a shell function bounds what it runs itself.
results=() failed=0
step_timeout="${STEP_TIMEOUT:-300}"
bounded=()
command -v timeout >/dev/null && bounded=(timeout --kill-after=10 "$step_timeout")
step() {
  local name="$1" rc t0
  shift
  t0=$(date +%s)
  if [ "$(type -t "$1")" = function ]; then
    "$@"
  else
    "${bounded[@]}" "$@"
  fi
  rc=$?
  if ((rc == 0)); then
    results+=("ok      $name ($(($(date +%s) - t0)) s)")
  else
    ((rc == 124 || rc == 137)) && echo "  $name: timed out after ${step_timeout} s"
    results+=("FAILED  $name (exit $rc after $(($(date +%s) - t0)) s)")
    failed=1
  fi
  return "$rc"
}
# fail NAME WHY: records a failure found without running anything.
fail() {
  echo "  FAILED: $1: $2"
  results+=("FAILED  $1: $2")
  failed=1
}
# figure ROW: a markdown row for the closing table (| what | figure | note |).
figures=()
figure() { figures+=("$1"); }
summary() {
  say "summary ($(($(date +%s) - started)) s; log in $log)"
  printf '  %s\n' "${results[@]}"
  if [ "${#figures[@]}" -gt 0 ]; then
    echo
    echo "| figure | value | against |"
    echo "|---|---|---|"
    printf '%s\n' "${figures[@]}"
  fi
  if ((failed)); then
    echo "gpu-check: FAILED (see the steps above)"
    exit 1
  fi
  echo "gpu-check: every step passed"
}

say "1. machine and kit"
(cd "$kit" && sha256sum --quiet -c manifest.txt) || die "the kit in $kit is incomplete or damaged (manifest.txt); bring every part-N folder and manifest.txt"
if ((rehearse)); then
  echo "  rehearsal: no GPU needed; the GPU tests may skip"
else
  command -v nvidia-smi >/dev/null || die "nvidia-smi not found: no NVIDIA driver here"
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv \
    || fail "nvidia-smi" "cannot query the GPU"
fi
# unpacked DIR FILE...: whether DIR was unpacked from FILE... since they
# last changed (its stamp is newer than each), so that a rerun unpacks
# nothing and a kit rebuilt over an old one is never run stale.
unpacked() {
  local stamp="$1/.unpacked" f
  shift
  [ -f "$stamp" ] || return 1
  for f; do [ "$stamp" -nt "$f" ] || return 1; done
}
# The ONNX Runtime parts in the order of their numeric suffix (part-10
# sorts before part-2 by name), and none missing.
parts=()
while IFS=$'\t' read -r _ p; do parts+=("$p"); done < <(
  for p in "$kit"/part-*/ort.tar.xz.*; do
    [ -e "$p" ] && printf '%s\t%s\n' "${p##*.}" "$p"
  done | sort -n -k1,1
)
[ "${#parts[@]}" -gt 0 ] || die "no ONNX Runtime parts (part-N/ort.tar.xz.NN) in $kit"
for i in "${!parts[@]}"; do
  suffix="${parts[$i]##*.}"
  [ "$((10#$suffix))" -eq "$i" ] || die "ONNX Runtime part $i is missing (found ${parts[$i]}); bring every part-N folder"
done
ort="$kit/ort"
if ! unpacked "$ort" "${parts[@]}"; then
  rm -rf "$ort"
  mkdir -p "$ort"
  if ! cat "${parts[@]}" | xz -d | tar -C "$ort" -xf -; then
    rm -rf "$ort"
    die "unpacking ONNX Runtime from ${#parts[@]} parts failed"
  fi
  ln -sf libonnxruntime.so.1.31.1 "$ort/libonnxruntime.so"
  touch "$ort/.unpacked"
fi
# The binaries and models (bin/, e2e/, models/), with their own stamp.
tools=("$kit"/part-*/tools.tar.xz)
[ -f "${tools[0]}" ] || die "no part-N/tools.tar.xz in $kit (the binaries and models); bring every part-N folder"
if ! unpacked "$kit/bin" "${tools[0]}"; then
  rm -rf "$kit/bin" "$kit/e2e" "$kit/models"
  xz -d <"${tools[0]}" | tar -C "$kit" -xf - || die "unpacking ${tools[0]} failed"
  touch "$kit/bin/.unpacked"
fi
export TIDEGATE_ORT_GPU_LIB="$ort/libonnxruntime.so" ORT_DYLIB_PATH="$ort/libonnxruntime.so"
export TIDEGATE_MODELS_DIR="$kit/models"
echo "  ONNX Runtime GPU build: $TIDEGATE_ORT_GPU_LIB"

# CUDA libraries: the toolkit, python3's nvidia-* packages, TIDEGATE_CUDA_LIBS.
dirs=()
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && dirs+=("$d")
done
if command -v python3 >/dev/null; then
  while IFS= read -r d; do dirs+=("$d"); done < <(python3 - <<'PY' 2>/dev/null || true
import glob, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()] + sys.path
seen = set()
for r in roots:
    for d in sorted(glob.glob(f"{r}/nvidia/*/lib") + glob.glob(f"{r}/nvidia/cu*/lib")
                    + glob.glob(f"{r}/tensorrt_libs")):
        if d not in seen:
            seen.add(d)
            print(d)
PY
  )
fi
IFS=: read -r -a extra <<<"${TIDEGATE_CUDA_LIBS:-}"
for d in "${extra[@]}"; do [ -n "$d" ] && dirs+=("$d"); done
# cudarc (built for CUDA 12) asks for libnvrtc.so / .so.12; CUDA 13 names it
# .so.13, so give it the plain name.
mkdir -p "$kit/lib"
for d in "${dirs[@]}"; do
  for f in "$d"/libnvrtc.so.1[0-9]*; do
    [ -e "$f" ] && [ ! -e "$kit/lib/libnvrtc.so" ] && ln -s "$f" "$kit/lib/libnvrtc.so"
  done
done
path="$kit/lib"
for d in "${dirs[@]}"; do path="$path:$d"; done
export LD_LIBRARY_PATH="$path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "  library path: $LD_LIBRARY_PATH"
if ((!rehearse)); then
  missing="$(ldd "$ort/libonnxruntime_providers_cuda.so" | awk '/not found/ {print $1}' | tr '\n' ' ')"
  [ -z "$missing" ] || fail "CUDA libraries" "the CUDA provider needs $missing: install CUDA 13 + cuDNN 9 (pip install 'onnxruntime-gpu[cuda,cudnn]==1.31.1') or point TIDEGATE_CUDA_LIBS at them"
  [ -e "$kit/lib/libnvrtc.so" ] || fail "NVRTC" "no libnvrtc.so.1x found in ${dirs[*]:-(no folder)}"
fi

# The end-to-end steps (6, 9) start the worker from e2e/, beside the gateway.
[ ! -d "$kit/e2e" ] || ln -sf "$kit/bin/tidegate-worker" "$kit/e2e/tidegate-worker"

# The CA the worker configs name: check-config reads it as the link would.
"$kit/e2e/tidegate-gateway" dev-certs --out "$kit/certs" >/dev/null \
  || die "cannot make a development CA with e2e/tidegate-gateway dev-certs"

# worker_config PROVIDER [MODEL [SEARCH [FILE]]]: writes FILE if given (its
# [runtime] table last when SEARCH is empty), else KIT/w-PROVIDER.toml, or
# KIT/w-PROVIDER-MODEL-SEARCH.toml (MODEL, default BlazeFace, only; SEARCH:
# cuDNN's conv_algo_search on CUDA).
worker_config() {
  local file="$kit/w-$1.toml" model="${2:-blazeface}"
  [ -n "${3:-}" ] && file="$kit/w-$1-$model-$3.toml"
  [ -n "${4:-}" ] && file="$4"
  cat >"$file" <<TOML
name = "gpu-check"
token = "unused"
[gateway]
addr = "127.0.0.1:9"
ca = "$kit/certs/ca.pem"
[models]
dir = "$kit/models"
only = ["$model"]
[runtime]
library = "$TIDEGATE_ORT_GPU_LIB"
provider = "$1"
TOML
  if [ -n "${3:-}" ]; then
    printf '[runtime.cuda]\nconv_algo_search = "%s"\n' "$3" >>"$file"
  fi
}
providers=(cpu)
((rehearse)) || providers+=(cuda)
for provider in "${providers[@]}"; do worker_config "$provider"; done

# precheck PROVIDER: check-config must pass and, on CUDA, report GPU
# preprocessing (the worker would otherwise serve on, preprocessing on the
# CPU, and the GPU numbers would be void).
precheck() {
  local out
  out="$("${bounded[@]}" "$kit/bin/tidegate-worker" --config "$kit/w-$1.toml" --log warn check-config)" || {
    printf '%s\n' "$out"
    return 1
  }
  printf '%s\n' "$out"
  if [ "$1" = cuda ] && ! grep -q "blazeface: preprocessing on gpu" <<<"$out"; then
    echo "  GPU preprocessing is off for blazeface (see the worker's warning above): NVRTC missing or failing?"
    return 1
  fi
}
if ((!rehearse)) && want 1b; then
  say "1b. tidegate-worker check-cuda: ONNX Runtime's CUDA provider, the driver and devices, NVRTC"
  step "check-cuda" "$kit/bin/tidegate-worker" --config "$kit/w-cuda.toml" --log warn check-cuda
fi
pre="${providers[-1]}"
if want 1c; then
  say "1c. pre-check: tidegate-worker check-config on $pre (loads every run-time library)"
  step "pre-check: check-config on $pre" precheck "$pre"
fi

want 2 && say "2. GPU tests (a skip fails here)"
if ! want 2; then
  :
elif ((rehearse)); then
  step "GPU tests" "$kit/bin/gpu-test" --nocapture --test-threads 1
  step "GPU unit tests" "$kit/bin/lib-test" gpu:: --nocapture
else
  step "GPU tests" env TIDEGATE_REQUIRE_GPU=1 "$kit/bin/gpu-test" --nocapture --test-threads 1
  step "GPU unit tests" env TIDEGATE_REQUIRE_GPU=1 "$kit/bin/lib-test" gpu:: --nocapture
fi

if want 3; then
  say "3. benchmarks: worker vs raw ONNX Runtime (frames/s, best of 2 rounds of 1 s)"
  echo "blazeface, CPU, 1 intra-op thread (baseline on this host):"
  step "bench blazeface CPU" "$kit/bin/bench" --threads 1 --seconds 1 --rounds 2
fi
if ((!rehearse)) && want 3; then
  for m in blazeface centernet; do
    [ -f "$kit/models/$m/model.onnx" ] || continue
    echo "$m, CUDA (third column: u8 upload + GPU normalise against CPU normalise + f32 upload):"
    step "bench $m CUDA" "$kit/bin/bench" --cuda --model "$m" --seconds 1 --rounds 2
  done
fi

want 4 && say "4. start-up: process start -> models loaded, warmed and profiled (check-config)"
for provider in "${providers[@]}"; do
  want 4 || break
  t0=$(date +%s%N)
  if step "start-up $provider" "$kit/bin/tidegate-worker" --config "$kit/w-$provider.toml" --log warn check-config; then
    t1=$(date +%s%N)
    echo "  $provider: $(((t1 - t0) / 1000000)) ms from exec to warmed and profiled"
  fi
done

if want 5; then
  say "5. cuDNN's convolution algorithm search (runtime.cuda.conv_algo_search): start-up per model, CenterNet's throughput"
  ((rehearse)) && echo "  rehearsal: on the CPU, where the setting does nothing; this checks the configurations only"
  for m in blazeface centernet; do
    [ -f "$kit/models/$m/model.onnx" ] || continue
    for search in exhaustive heuristic default; do
      worker_config "$pre" "$m" "$search"
      t0=$(date +%s%N)
      if step "start-up $pre $m $search" "$kit/bin/tidegate-worker" --config "$kit/w-$pre-$m-$search.toml" --log warn check-config >/dev/null; then
        t1=$(date +%s%N)
        echo "  $m, $search: $(((t1 - t0) / 1000000)) ms from exec to warmed and profiled"
      fi
    done
  done
  if ((!rehearse)) && [ -f "$kit/models/centernet/model.onnx" ]; then
    for search in exhaustive heuristic default; do
      echo "centernet, CUDA, conv_algo_search = $search (raw ONNX Runtime on the same setting):"
      step "bench centernet CUDA $search" "$kit/bin/bench" --cuda --model centernet \
        --conv-algo-search "$search" --sizes 1,8,32 --seconds 1 --rounds 1
    done
  fi
fi

# e2e MODEL CAMERAS FPS: one bounded load test through a local gateway and
# one worker on $pre; prints the report's numbers, keeps the JSON. On a GPU
# it fails unless E2E_MIN_SLO (default 0.99) of the frames due are ok within
# the budget.
e2e() {
  local json="${OUT:-$kit}/e2e-$1.json" gate=() rc=0
  ((rehearse)) || gate=(--min-slo-attainment "${E2E_MIN_SLO:-0.99}")
  rm -f "$json"
  TIDEGATE_BIN_DIR="$kit/e2e" "${bounded[@]}" "$kit/e2e/tidegate-loadtest" --local \
    --worker-provider "$pre" --models-dir "$kit/models" --model "$1" \
    --cameras "$2" --fps "$3" --seconds "${E2E_SECONDS:-15}" --report "$json" \
    "${gate[@]}" >/dev/null || rc=$?
  [ -f "$json" ] || return "$((rc ? rc : 1))"
  python3 - "$json" <<'PY' || return
import json, sys
r = json.load(open(sys.argv[1]))
e = r["e2e_ms"]
print(f"  {r['cameras']} cameras x {r['fps']:g} fps for {r['duration_s']:g} s, budget {r['budget_ms']} ms: "
      f"sent {r['sent']}, ok {r['ok']}, ok within budget {r['ok_within_budget']}, "
      f"SLO attainment {r['slo_attainment']:.4f}")
print(f"  end to end ms: p50 {e['p50']:.1f}, p90 {e['p90']:.1f}, p99 {e['p99']:.1f}, max {e['max']:.1f}; "
      f"shed {r['shed']}, expired {r['expired']}, failed {r['failed']}, missing {r['missing']}, hints {r['hints']}")
PY
  return "$rc"
}
# The end-to-end loads (model, cameras, fps per camera) of step 6, and
# where step 9's ramps start.
if ((rehearse)); then
  e2e_loads=("blazeface 4 10" "centernet 1 2")
else
  e2e_loads=("blazeface 32 30" "centernet 16 15")
fi
if want 6; then
  say "6. end to end: tidegate-loadtest --local, a gateway and one worker on $pre (QUIC on 127.0.0.1, 80 ms budget)"
  if [ ! -x "$kit/e2e/tidegate-loadtest" ] || [ ! -x "$kit/e2e/tidegate-gateway" ]; then
    fail "end to end" "no e2e/tidegate-loadtest and e2e/tidegate-gateway in the kit"
  else
    for load in "${e2e_loads[@]}"; do
      read -r m cams fps <<<"$load"
      [ -f "$kit/models/$m/model.onnx" ] || continue
      echo "$m:"
      step "end to end $m, $cams cameras x $fps fps, $pre worker" e2e "$m" "$cams" "$fps"
    done
  fi
fi

# gpu_metrics: a worker on $pre with --metrics-listen (its gateway need not
# answer: /metrics is served from the start), scraped once its models are
# warm. On a GPU, each series the dashboard's GPU panels read (utilisation,
# memory used and total, power, temperature) must be there for a real GPU
# index, with gpu_info naming the board; in a rehearsal, the CPU's
# gpu_info{gpu="none"} and no per-GPU series.
gpu_metrics() {
  local wlog="${OUT:-$kit}/worker-metrics.log" pid addr="" rc=0
  "$kit/bin/tidegate-worker" --config "$kit/w-$pre.toml" --metrics-listen 127.0.0.1:0 \
    --log warn >"$wlog" 2>&1 &
  pid=$!
  for _ in $(seq 1 1200); do
    addr=$(sed -n 's/^metrics listening on //p' "$wlog" | head -1)
    [ -n "$addr" ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if [ -z "$addr" ]; then
    echo "  the worker never said where its metrics listen; its log ends:"
    tail -5 "$wlog"
    kill "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    return 1
  fi
  python3 - "$addr" "$rehearse" <<'PY' || rc=$?
import re, sys, urllib.request
addr, rehearse = sys.argv[1], sys.argv[2] == "1"
text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
def gpus(name):
    return {m.group(1): line.rsplit(" ", 1)[1] for line in text.splitlines()
            if line.startswith(name + "{") and (m := re.search(r'gpu="([^"]*)"', line))}
info = gpus("tidegate_worker_gpu_info")
print(f"  tidegate_worker_gpu_info: {info}")
per_gpu = ["tidegate_worker_gpu_utilization_ratio", "tidegate_worker_gpu_memory_used_bytes",
           "tidegate_worker_gpu_memory_total_bytes", "tidegate_worker_gpu_power_watts",
           "tidegate_worker_gpu_temperature_celsius"]
bad = []
if rehearse:
    if list(info) != ["none"]:
        bad.append(f"a CPU worker exports gpu_info {info}, not gpu=none alone")
    bad += [f"{n} exported on a CPU: {gpus(n)}" for n in per_gpu if gpus(n)]
else:
    if not info or "none" in info:
        bad.append(f"no GPU read through NVML: gpu_info {info}")
    for n in per_gpu:
        got = {g: v for g, v in gpus(n).items() if g != "none"}
        print(f"  {n}: {got}")
        if not got:
            bad.append(f"{n}: no series for a GPU")
for b in bad:
    print(f"  {b}")
sys.exit(1 if bad else 0)
PY
  kill "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  return "$rc"
}
if want 7; then
  say "7. worker metrics on $pre: the GPU series the dashboard's GPU panels read (NVML)"
  step "worker metrics $pre" gpu_metrics
fi

# profiled CONFIG-FILE: runs check-config (models loaded, warmed and
# profiled) and writes "ready_ms batch:latency_us ..." from its log to
# KIT/profiled.out.
profiled() {
  local t0 t1 out
  rm -f "$kit/profiled.out"
  t0=$(date +%s%N)
  out="$("${bounded[@]}" "$kit/bin/tidegate-worker" --config "$1" --log info check-config 2>&1)" || {
    printf '%s\n' "$out" | tail -5
    return 1
  }
  t1=$(date +%s%N)
  out="$(printf '%s\n' "$out" | sed 's/\x1b\[[0-9;]*m//g')"
  printf '%s\n' "$out" | grep -E 'TensorRT|precision|fp16|FP32' | sed 's/^/  /'
  {
    printf '%s' "$(((t1 - t0) / 1000000))"
    printf '%s\n' "$out" \
      | sed -n 's/.*profiled model=[^ ]* batch=\([0-9]*\) latency_us=\([0-9]*\).*/ \1:\2/p' | tr -d '\n'
    echo
  } >"$kit/profiled.out"
}
# The worker's own best throughput per model (frames/s over its profiled
# batch sizes, FP32 on $pre), from step 8, for step 9's ratio.
declare -A alone=()
if want 8; then
  say "8. precision and TensorRT: profile per batch size (frames/s) and time to ready"
  ((rehearse)) && echo "  rehearsal: FP32 and FP16 on the CPU; TensorRT is not tried"
  for m in blazeface centernet; do
    [ -f "$kit/models/$m/model.onnx" ] || continue
    configs=("$pre fp32" "$pre fp16")
    ((rehearse)) || configs+=("tensorrt fp16 cold" "tensorrt fp16 warm")
    declare -A fps=() ready=()
    for c in "${configs[@]}"; do
      read -r prov prec cache <<<"$c"
      file="$kit/w-8-$m-$prov-$prec${cache:+-$cache}.toml"
      worker_config "$prov" "$m" "" "$file"
      printf 'precision = "%s"\n' "$prec" >>"$file"
      if [ "$prov" = tensorrt ]; then
        printf '[runtime.tensorrt]\nengine_cache_dir = "%s"\n' "$kit/trt-cache" >>"$file"
        [ "$cache" = cold ] && rm -rf "$kit/trt-cache"
      fi
      if step "precision $m $c" profiled "$file"; then
        read -r ms points <"$kit/profiled.out"
        ready[$c]=$ms
        echo "  $m, $c: ready in $ms ms; batch:µs $points"
        for pt in $points; do fps[$c,${pt%%:*}]=$(( ${pt%%:*} * 1000000 / (${pt##*:} > 0 ? ${pt##*:} : 1) ))
        done
      fi
    done
    base="${configs[0]}"
    for k in "${!fps[@]}"; do
      [ "${k%,*}" = "$base" ] && [ "${fps[$k]}" -gt "${alone[$m]:-0}" ] && alone[$m]=${fps[$k]}
    done
    for c in "${configs[@]:1}"; do
      b=32
      [ -n "${fps[$c,$b]:-}" ] || b=1
      if [ -n "${fps[$c,$b]:-}" ] && [ -n "${fps[$base,$b]:-}" ] && [ "${fps[$base,$b]}" -gt 0 ]; then
        figure "| $m, $c, batch $b | ${fps[$c,$b]} frames/s ($(python3 -c "print(f'{${fps[$c,$b]}/${fps[$base,$b]}:.2f}')")x) | $base ${fps[$base,$b]} frames/s |"
      fi
    done
    for c in "${configs[@]}"; do
      [ -n "${ready[$c]:-}" ] && figure "| $m, $c, time to ready | ${ready[$c]} ms | process start to warmed and profiled |"
    done
    unset fps ready
  done
fi

if want 9; then
  say "9. the whole path at the GPU's speed: each model ramped end to end to its highest rate within the SLO"
  for r in "${e2e_loads[@]}"; do
    read -r m cams start <<<"$r"
    [ -f "$kit/models/$m/model.onnx" ] || continue
    out="${OUT:-$kit}/ramp-$m.jsonl"
    points=8
    ((rehearse)) && points=2
    if step "ramp $m on $pre" python3 "$here/gpu-ramp.py" --bin-dir "$kit/e2e" --models-dir "$kit/models" \
      --provider "$pre" --model "$m" --cameras "$cams" --start-fps "$start" \
      --seconds "${RAMP_SECONDS:-10}" --points "$points" >"$out"; then
      cat "$out" | sed 's/^/  /'
      read -r max gcpu < <(python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])][-1]; print(r['max_fps_within_slo'], r['gateway_cpu_s_per_1k'])" "$out")
      if [ -n "${alone[$m]:-}" ]; then
        against="$(python3 -c "print(f'{$max / ${alone[$m]}:.2f}')")x the worker alone (${alone[$m]} frames/s at its best batch, step 8, $pre fp32)"
      else
        against="the worker alone: run step 8 too for the ratio"
      fi
      figure "| $m end to end on $pre, max fps within the SLO | $max frames/s | $against |"
      figure "| $m end to end, gateway CPU per 1,000 frames | $gcpu CPU-s | at that rate |"
    fi
  done
fi

# wan_case NAME: one case of make bench-wan, the workers on $pre, serving
# the kit's models; prints its row of the WAN table, keeps the JSON.
wan_case() {
  local json="${OUT:-$kit}/wan-$1.json" md="${OUT:-$kit}/wan-$1.md" seconds=30 rc=0
  ((rehearse)) && seconds=5
  rm -f "$json" "$md"
  TIDEGATE_BIN_DIR="$kit/e2e" "${bounded[@]}" "$kit/e2e/tidegate-bench" --report "$json" wan \
    --cases "$1" --seconds "$seconds" --worker-provider "$pre" --models-dir "$kit/models" \
    --markdown "$md" >/dev/null 2>"${OUT:-$kit}/wan-$1.log" || rc=$?
  [ -f "$md" ] || { tail -n 20 "${OUT:-$kit}/wan-$1.log"; return "$((rc ? rc : 1))"; }
  tail -n 1 "$md" | sed 's/^/  /'
  return "$rc"
}
if want 10; then
  say "10. the WAN case that waits for a GPU: CenterNet 4 x 5 fps through the impairment relay (20 ms RTT, 2 % bursty loss), the workers on $pre"
  case_name=20ms-2pct-bursty-centernet
  if [ ! -x "$kit/e2e/tidegate-bench" ]; then
    fail "WAN $case_name" "no e2e/tidegate-bench in the kit"
  elif [ ! -f "$kit/models/centernet/model.onnx" ]; then
    fail "WAN $case_name" "no CenterNet in the kit (models/fetch.sh fetches it)"
  elif step "WAN $case_name, workers on $pre" wan_case "$case_name"; then
    read -r ok missing dup < <(python3 -c "
import json, sys
r = json.load(open(sys.argv[1]))['cases'][0]['report']
print(f\"{r['slo_attainment'] * 100:.1f}\", r['missing'], r['duplicates'])" "${OUT:-$kit}/wan-$case_name.json")
    figure "| WAN: CenterNet 4 x 5 fps, 20 ms RTT, 2 % bursty loss, workers on $pre | $ok % ok within 80 ms (missing $missing, dup $dup) | goal >= 95 %, missing 0 (make bench-wan's $case_name) |"
  fi
fi

summary
