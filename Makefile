# tidegate: every entry point a newcomer needs.
#   make demo   set up, build, and run gateway + worker + edge locally
#   make test   set up, then run every test (what CI runs)
SHELL := /bin/bash
CARGO ?= cargo

.PHONY: setup build release images images-cuda demo test lint fmt loadtest loadtest-scenario bench bench-wan bench-hostile bench-peers bench-leasing profile-frame gpu-check models-full fuzz clean-cache

## Install what is missing: Debian GStreamer packages, ONNX Runtime, models, test images and video.
setup:
	@bash scripts/setup.sh

build: setup
	$(CARGO) build --workspace --bins

release: setup
	$(CARGO) build --workspace --release --bins

## Container images of the gateway and the (CPU) worker, as OCI archives:
## target/images/tidegate-{gateway,worker}-<version>.oci.tar (scripts/image.py).
images: release
	python3 scripts/image.py --bin-dir $${CARGO_TARGET_DIR:-target}/release --out $${CARGO_TARGET_DIR:-target}/images

## The worker for leased GPUs (what deploy/kubernetes/ leases): built with the
## cuda feature, with ONNX Runtime's GPU build, CUDA 13 and cuDNN 9 (pinned
## wheels, 1.3 GB to fetch once): target/images/tidegate-worker-cuda-<version>.oci.tar.
images-cuda: setup
	@bash scripts/setup.sh --cuda
	$(CARGO) build --release -p tidegate-worker --features cuda --bins
	python3 scripts/image.py --bin-dir $${CARGO_TARGET_DIR:-target}/release --out $${CARGO_TARGET_DIR:-target}/images --only worker-cuda

## Gateway, one worker and one edge with two cameras (faces in astronaut.png at
## 5 fps, people and cars in vtest.avi at 2 fps); prints results until Ctrl-C.
demo: release
	@bash scripts/demo.sh

## Every test: unit, property, fuzz-corpus replay, and the multi-process integration tests.
## Its setup adds the CUDA worker image's libraries (setup.sh --cuda), which
## deploy/tests/container_images.rs builds that image from.
## CPU_HOGS=N runs the tests (once built) with N busy loops beside them
## (scripts/with-cpu-hogs.sh), as on a machine that other work keeps busy;
## CI runs one. Tests assert no speed, so they pass with or without.
CPU_HOGS ?= 0
test:
	@bash scripts/setup.sh --cuda
	$(CARGO) build --workspace --bins
	$(CARGO) test --workspace --all-features --no-run
	bash scripts/with-cpu-hogs.sh $(CPU_HOGS) -- $(CARGO) test --workspace --all-features --no-fail-fast

lint: setup
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets --all-features -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --no-deps --all-features
	python3 scripts/shape.py --self-test
	python3 scripts/shape.py

fmt:
	$(CARGO) fmt --all

## A bounded load test against a local cluster; report in target/loadtest.json and .svg.
loadtest: release
	./target/release/tidegate-loadtest --local --workers 1 --cameras 4 --fps 10 --seconds 10 \
	  --report target/loadtest.json --svg target/loadtest.svg

## The rush-hour scenario (loadtest/scenarios/): four phases of load, each
## with its report and SLO gate; report in target/scenario.json.
loadtest-scenario: release
	./target/release/tidegate-loadtest --local --workers 2 --scenario loadtest/scenarios/rush-hour.toml \
	  --report target/scenario.json --svg target/scenario.svg

## Scheduler cost, relay overhead against raw quinn, overload with and
## without frame-rate hints, and a worker's time to ready; JSON in
## target/bench-*.json.
bench: release
	./target/release/tidegate-bench --report target/bench-scheduler.json scheduler
	./target/release/tidegate-bench --report target/bench-relay-1.json relay --frames 2000 --concurrency 1
	./target/release/tidegate-bench --report target/bench-relay-8.json relay --frames 4000 --concurrency 8
	./target/release/tidegate-bench --report target/bench-hints.json hints --workers 1 --cameras 32 --fps 30 --seconds 5 --rounds 2
	./target/release/tidegate-bench --report target/bench-startup.json startup --runs 5

## The WAN matrix: the load generator through the project's impairment relay
## (RTT, random and bursty loss, a bandwidth cap, blackouts; each congestion
## controller on the same links; raw against JPEG; the real edge), 30 s a case, about 25
## minutes in all. JSON in target/bench-wan.json; the table is written into
## docs/benchmarks.md ("WAN"). CASES=blackout runs only the cases so named.
bench-wan: release
	./target/release/tidegate-bench --report target/bench-wan.json wan --seconds $${SECONDS_PER_CASE:-30} \
	  $${CASES:+--cases $$CASES} --markdown target/bench-wan.md
	python3 scripts/splice-doc.py docs/benchmarks.md bench-wan target/bench-wan.md

## Hostile edges, a lying worker and slowloris (issue 21), each beside a
## legitimate load (4 cameras × 10 fps) on a fresh cluster: the legitimate
## edge's ok share and p99 against its baseline in the same run, the
## gateway's peak RSS against 256 MiB plus its budgets, and its return.
## SECONDS_PER_CASE (default 15) is each run of the load; 10 cases, about
## 17 minutes at 15 s and 3 runs a case (REPEAT). JSON in target/bench-hostile.json; the table is
## written into docs/benchmarks.md ("Hostile edges"). CASES=liar runs only
## the cases so named.
bench-hostile: release
	./target/release/tidegate-bench --report target/bench-hostile.json hostile --seconds $${SECONDS_PER_CASE:-15} \
	  --repeat $${REPEAT:-3} $${CASES:+--cases $$CASES} --markdown target/bench-hostile.md
	python3 scripts/splice-doc.py docs/benchmarks.md bench-hostile target/bench-hostile.md

## Every leasing policy x every shipped trace (lease-core/traces/) x 3 seeds x two
## clouds (the default, and a harsh one: 420 s start-ups, 10x the catalog's
## spot interruptions, 20 % of spot acquires refused), in the simulator
## (lease-core/examples/bench-leasing.rs): 270 runs, about 45 minutes on 2 cores
## (SEEDS=1 runs one seed). The table (mean and min-max over seeds; whether paid-block-aware
## meets its goal per trace) is written into docs/leasing.md ("Benchmark").
bench-leasing:
	$(CARGO) run --release -p tidegate-lease-core --example bench-leasing -- \
	  $${SEEDS:+--seeds $$SEEDS} --markdown $${CARGO_TARGET_DIR:-target}/bench-leasing.md
	python3 scripts/splice-doc.py docs/leasing.md bench-leasing $${CARGO_TARGET_DIR:-target}/bench-leasing.md

## tidegate against the servers users know, on this machine: NVIDIA Triton
## (PyTriton, python backend + ONNX Runtime, dynamic batching), FastAPI +
## ONNX Runtime and tidegate-baseline (the same ORT sessions behind the
## simplest HTTP server), each ramped to its max fps within the 80 ms SLO
## (scripts/bench-peers.py; the peers' pinned venv: loadtest/peers/setup.sh).
## ALIGNED=1 puts the cameras in step. About 30 minutes; JSON in
## target/bench-peers.json, the table written into docs/benchmarks.md.
bench-peers: release
	python3 scripts/bench-peers.py $${ALIGNED:+--aligned} --markdown target/bench-peers.md
	python3 scripts/splice-doc.py docs/benchmarks.md bench-peers$${ALIGNED:+-aligned} target/bench-peers.md

## Where a frame's CPU goes: the gateway and 2 workers under a steady load,
## recorded with perf (Debian's linux-perf) and split by what each sample's
## symbol belongs to (scripts/profile-frame.py); the table is written into
## docs/benchmarks.md ("Where a frame's CPU goes"). About a minute.
profile-frame: release
	@command -v perf >/dev/null || { echo "perf is missing: sudo apt-get install linux-perf"; exit 1; }
	python3 scripts/profile-frame.py --markdown target/profile-frame.md
	python3 scripts/splice-doc.py docs/benchmarks.md profile-frame target/profile-frame.md

## On a machine with an NVIDIA GPU: the worker's GPU tests, CUDA benchmarks,
## start-up and an end-to-end load test with a CUDA worker
## (scripts/gpu-check.sh; docs/benchmarks.md has an H200's numbers).
gpu-check: setup
	@bash scripts/gpu-check.sh

## Every model (BlazeFace, and CenterNet and emotion converted from TF.js by
## the pinned model tools): fetches and converts what is missing and checks
## each file against its pinned sha256. make setup runs it too.
models-full:
	@bash models/fetch.sh

## Run the protocol fuzzer for 60 s, the gateway-address parser's, the
## edge's webhook-answer and the KServe codec's fuzzers for 30 s each (needs cargo-fuzz and a
## nightly toolchain).
fuzz:
	cd protocol && $(CARGO) +nightly fuzz run decode -- -max_total_time=60
	cd protocol && $(CARGO) +nightly fuzz run gateway_addr -- -max_total_time=30
	cd edge && $(CARGO) +nightly fuzz run webhook_status -- -max_total_time=30
	cd loadtest && $(CARGO) +nightly fuzz run kserve_codec -- -max_total_time=30
