#!/usr/bin/env python3
"""The whole path at the GPU's speed (issue 20, scripts/gpu-check.sh step 9).

    gpu-ramp.py --bin-dir KIT/e2e --models-dir KIT/models --provider cuda \
                --model blazeface --cameras 32 --start-fps 30 [--seconds 10]

Ramps one model's load through `tidegate-loadtest --local` (a gateway and
one worker on 127.0.0.1, QUIC, the 80 ms budget): the per-camera rate
goes up by 1.25x while at least 99 % of the frames planned are ok within
the budget, then halves the gap to the first rate that is not, until the
two are within 6 % (at most --points runs). For each run it reads the
gateway's CPU time from /proc (the loadtest's child named
tidegate-gateway) and prints one JSON line; the last line is the result:
the highest total fps within the SLO and the gateway's CPU-s per 1,000
frames at that rate.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

GOAL = 0.99
TICK = os.sysconf("SC_CLK_TCK")


def children(pid):
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                with open(f"/proc/{p}/comm") as f:
                    out.append((int(p), f.read().strip()))
        except OSError:
            continue
    return out


def cpu_s(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    except OSError:
        return None


def run_point(args, fps):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        report = f.name
    argv = [os.path.join(args.bin_dir, "tidegate-loadtest"), "--local",
            "--worker-provider", args.provider, "--models-dir", args.models_dir,
            "--model", args.model, "--cameras", str(args.cameras), "--fps", f"{fps:.3f}",
            "--seconds", str(args.seconds), "--report", report]
    env = dict(os.environ, TIDEGATE_BIN_DIR=args.bin_dir)
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    gateway, last = None, None
    deadline = time.time() + args.seconds * 4 + 300
    while proc.poll() is None and time.time() < deadline:
        if gateway is None:
            # /proc's comm keeps 15 characters: "tidegate-gatewa".
            gateway = next((p for p, name in children(proc.pid)
                            if "tidegate-gateway".startswith(name) and len(name) >= 14), None)
        if gateway is not None:
            last = cpu_s(gateway) or last
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    err = proc.communicate()[1]
    if proc.returncode != 0:
        sys.exit(f"gpu-ramp: {' '.join(argv)} failed ({proc.returncode}):\n{err[-3000:]}")
    with open(report) as f:
        r = json.load(f)
    os.unlink(report)
    planned = r.get("planned") or r["sent"]
    point = {
        "model": args.model,
        "total_fps": round(fps * args.cameras, 1),
        "attainment": r["ok_within_budget"] / planned if planned else 0.0,
        "missing": r["missing"],
        "p50_ms": r["e2e_ms"]["p50"],
        "p99_ms": r["e2e_ms"]["p99"],
        "gateway_cpu_s_per_1k": round(1000 * last / r["sent"], 3) if last and r["sent"] else None,
    }
    print(json.dumps(point), flush=True)
    return point


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--models-dir", required=True)
    ap.add_argument("--provider", default="cuda")
    ap.add_argument("--model", required=True)
    ap.add_argument("--cameras", type=int, required=True)
    ap.add_argument("--start-fps", type=float, required=True, help="per camera")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--points", type=int, default=8)
    args = ap.parse_args()
    good, bad, fps = None, None, args.start_fps
    for _ in range(args.points):
        p = run_point(args, fps)
        if p["attainment"] >= GOAL and p["missing"] == 0:
            good = p
            if bad is None:
                fps *= 1.25
                continue
        else:
            bad = p
            if good is None:
                fps /= 1.6
                continue
        if good and bad and bad["total_fps"] / good["total_fps"] < 1.06:
            break
        fps = (good["total_fps"] + bad["total_fps"]) / 2 / args.cameras
    result = {"result": True, "model": args.model,
              "max_fps_within_slo": good["total_fps"] if good else 0.0,
              "gateway_cpu_s_per_1k": good["gateway_cpu_s_per_1k"] if good else None}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
