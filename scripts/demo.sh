#!/usr/bin/env bash
# make demo: gateway + one worker + one edge with two cameras, all on
# 127.0.0.1: faces (BlazeFace) in astronaut.png, and people and vehicles
# (CenterNet, COCO) in the street video vtest.avi, looping. Prints each
# result (JSON, with end-to-end latency and class names) until Ctrl-C.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bin="${TIDEGATE_BIN:-${CARGO_TARGET_DIR:-$root/target}/release}"
run="$root/.cache/demo"
mkdir -p "$run"
export TIDEGATE_LOG="${TIDEGATE_LOG:-warn}"

"$bin/tidegate-gateway" dev-certs --out "$run/certs" >/dev/null
edge_token="$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
worker_token="$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
cat > "$run/gateway.toml" <<TOML
[quic]
listen = "127.0.0.1:4433"
cert = "certs/gateway.pem"
key = "certs/gateway.key"
[http]
listen = "127.0.0.1:9090"
[[edges]]
name = "demo-edge"
token_sha256 = "$("$bin/tidegate-gateway" hash-token "$edge_token")"
[[workers]]
name = "demo-worker"
token_sha256 = "$("$bin/tidegate-gateway" hash-token "$worker_token")"
TOML
cat > "$run/worker.toml" <<TOML
name = "demo-worker"
[gateway]
addr = "127.0.0.1:4433"
ca = "certs/ca.pem"
[models]
dir = "$root/models"
only = ["blazeface", "centernet"]
TOML
cat > "$run/edge.toml" <<TOML
name = "demo-edge"
[gateway]
addr = "127.0.0.1:4433"
ca = "certs/ca.pem"
[[cameras]]
name = "astronaut"
uri = "image://$root/models/testdata/astronaut.png"
model = "blazeface"
budget_ms = 80
max_fps = 5
encoding = "jpeg"       # the default; "png" or "raw" (docs/operations.md)
jpeg_quality = 90       # the highest; adaptation may go down to min_jpeg_quality (50)
[[cameras]]
name = "street"
uri = "file://$root/models/testdata/vtest/vtest.avi"
loop = true
model = "centernet"
budget_ms = 80
max_fps = 2
TOML

pids=()
cleanup() {
  trap - INT TERM EXIT
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  echo "demo stopped."
}
trap cleanup INT TERM EXIT

"$bin/tidegate-gateway" --config "$run/gateway.toml" run > "$run/gateway.out" &
pids+=($!)
TIDEGATE_WORKER_TOKEN="$worker_token" "$bin/tidegate-worker" --config "$run/worker.toml" &
pids+=($!)
echo "gateway: QUIC 127.0.0.1:4433, status page http://127.0.0.1:9090/, metrics http://127.0.0.1:9090/metrics"
echo "results from cameras 'astronaut' (faces) and 'street' (people, cars) (Ctrl-C to stop):"
TIDEGATE_EDGE_TOKEN="$edge_token" "$bin/tidegate-edge" --config "$run/edge.toml" &
pids+=($!)
wait "${pids[2]}"
