#!/usr/bin/env bash
# Edge overhead against raw GStreamer: CPU time per frame of the edge's
# capture path (examples/bench_capture.rs: the same pipeline, gate, copy and
# async consumer as tidegate-edge) against gst-launch-1.0 running the same
# decode → rate → scale → convert → letterbox pipeline into fakesink, on
# H.264 files made here from videotestsrc. Both are timed the same way
# (user + system CPU of the process, bash's `time`), best of REPEATS runs.
# Start-up (GStreamer's plugin registry, the runtime) is taken out by timing
# a FRAMES-frame file and a SHORT-frame file of the same stream:
#   CPU per frame = (cpu(FRAMES) - cpu(SHORT)) / (FRAMES - SHORT).
#
#   scripts/bench-edge.sh                 # 720p and 1080p, 128×128 and 512×512
#   FRAMES=600 REPEATS=5 scripts/bench-edge.sh
#
# Writes a Markdown table to stdout. Needs gstreamer1.0-tools, -plugins-ugly
# (x264enc) and -libav (avdec_h264): `make setup`.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
FRAMES="${FRAMES:-300}"
SHORT="${SHORT:-30}"
FPS="${FPS:-30}"
REPEATS="${REPEATS:-3}"
target="${CARGO_TARGET_DIR:-$root/target}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

command -v gst-launch-1.0 >/dev/null || { echo "gst-launch-1.0 missing: make setup" >&2; exit 1; }
(cd "$root" && cargo build --release -q -p tidegate-edge --example bench_capture)
bench="$target/release/examples/bench_capture"

# CPU seconds (user + system) of one run of "$@".
cpu_of() {
  local TIMEFORMAT='%U %S' t
  t="$( { time "$@" >/dev/null 2>&1; } 2>&1 )"
  awk '{printf "%.3f", $1 + $2}' <<<"$t"
}

best_of() {
  local best="" t
  for _ in $(seq "$REPEATS"); do
    t="$(cpu_of "$@")"
    if [ -z "$best" ] || awk -v a="$t" -v b="$best" 'BEGIN{exit !(a<b)}'; then best="$t"; fi
  done
  echo "$best"
}

# CPU per frame (ms) of "$@" with FILE replaced by the long and short file.
per_frame() {
  local long="$1" short="$2"; shift 2
  local a b
  a="$(best_of "${@//@FILE@/$long}")"
  b="$(best_of "${@//@FILE@/$short}")"
  awk -v a="$a" -v b="$b" -v n="$FRAMES" -v m="$SHORT" 'BEGIN{printf "%.3f", 1000*(a-b)/(n-m)}'
}

echo "| source | model input | gst-launch ms/frame | edge ms/frame | edge / gst | edge + motion gate ms/frame |"
echo "|---|---|---|---|---|---|"
for src in 1280x720 1920x1080; do
  w="${src%x*}"; h="${src#*x}"
  for n in "$FRAMES" "$SHORT"; do
    gst-launch-1.0 -q videotestsrc num-buffers="$n" pattern=ball \
      ! "video/x-raw,width=$w,height=$h,framerate=$FPS/1" ! videoconvert \
      ! x264enc speed-preset=veryfast key-int-max=30 ! mp4mux \
      ! filesink location="$work/$src-$n.mp4" >/dev/null
  done
  long="$work/$src-$FRAMES.mp4"; short="$work/$src-$SHORT.mp4"
  for size in 128 512; do
    # Letterbox geometry exactly as the edge computes it (16:9 into a square).
    ch=$(( (h * size + w / 2) / w )); top=$(( (size - ch) / 2 )); bottom=$(( size - ch - top ))
    gst_ms="$(per_frame "$long" "$short" gst-launch-1.0 -q uridecodebin uri="file://@FILE@" \
      ! videorate drop-only=true ! "video/x-raw,framerate=[0/1,$FPS/1]" \
      ! videoscale add-borders=false ! "video/x-raw,width=$size,height=$ch" ! videoconvert \
      ! videobox top="-$top" bottom="-$bottom" ! "video/x-raw,format=RGB,width=$size,height=$size" \
      ! fakesink sync=true)"
    edge_ms="$(per_frame "$long" "$short" "$bench" "file://@FILE@" "$size" "$size" "$FPS")"
    gate_ms="$(per_frame "$long" "$short" "$bench" "file://@FILE@" "$size" "$size" "$FPS" 0.01)"
    awk -v s="$src" -v z="$size" -v g="$gst_ms" -v e="$edge_ms" -v m="$gate_ms" 'BEGIN{
      printf "| %s H.264 | %d×%d | %.2f | %.2f | %.2f | %.2f |\n", s, z, z, g, e, e/g, m }'
  done
done

# FULL=1: also the whole tidegate-edge binary (release) sending every frame
# over QUIC to a local gateway and worker (BlazeFace, so 128×128 only),
# results written to a file: what an edge really spends per frame.
if [ "${FULL:-0}" = 1 ]; then
  bins="${TIDEGATE_BIN_DIR:-$target/debug}"
  (cd "$root" && cargo build --release -q -p tidegate-edge --bin tidegate-edge)
  [ -x "$bins/tidegate-gateway" ] && [ -x "$bins/tidegate-worker" ] \
    || { echo "build the gateway and worker first: cargo build -p tidegate-gateway -p tidegate-worker" >&2; exit 1; }
  quic="127.0.0.1:${QUIC_PORT:-47433}"; http="127.0.0.1:${HTTP_PORT:-47090}"
  "$bins/tidegate-gateway" dev-certs --out "$work/certs" >/dev/null
  et="$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')"
  wt="$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')"
  cat > "$work/gateway.toml" <<TOML
[quic]
listen = "$quic"
cert = "certs/gateway.pem"
key = "certs/gateway.key"
[http]
listen = "$http"
[[edges]]
name = "bench-edge"
token_sha256 = "$("$bins/tidegate-gateway" hash-token "$et")"
[[workers]]
name = "bench-worker"
token_sha256 = "$("$bins/tidegate-gateway" hash-token "$wt")"
TOML
  cat > "$work/worker.toml" <<TOML
name = "bench-worker"
[gateway]
addr = "$quic"
ca = "certs/ca.pem"
[models]
dir = "$root/models"
only = ["blazeface"]
TOML
  TIDEGATE_LOG=warn "$bins/tidegate-gateway" --config "$work/gateway.toml" run >/dev/null 2>"$work/gateway.log" &
  gw=$!
  TIDEGATE_LOG=warn TIDEGATE_WORKER_TOKEN="$wt" "$bins/tidegate-worker" --config "$work/worker.toml" 2>"$work/worker.log" &
  wk=$!
  trap 'kill $gw $wk 2>/dev/null; rm -rf "$work"' EXIT
  for _ in $(seq 120); do curl -sf "http://$http/readyz" >/dev/null && break; sleep 0.5; done
  for n in "$FRAMES" "$SHORT"; do
    cat > "$work/edge-$n.toml" <<TOML
name = "bench-edge"
[gateway]
addr = "$quic"
ca = "certs/ca.pem"
[[cameras]]
name = "bench"
uri = "file://$work/1920x1080-$n.mp4"
model = "blazeface"
max_fps = $FPS
TOML
  done
  export TIDEGATE_EDGE_TOKEN="$et" TIDEGATE_LOG=error
  full_ms="$(per_frame "$work/edge-$FRAMES.toml" "$work/edge-$SHORT.toml" \
    "$target/release/tidegate-edge" --config "@FILE@" --results /dev/null --summary-every 0)"
  echo
  echo "| source | model input | tidegate-edge ms/frame (capture + QUIC + results) |"
  echo "|---|---|---|"
  printf '| 1920x1080 H.264 | 128×128 | %.2f |\n' "$full_ms"
fi
