#!/usr/bin/env python3
"""make profile-frame: where a frame's CPU goes in the gateway and the workers.

Runs `tidegate-loadtest --local` (a gateway and 2 workers x 1 thread serving
BlazeFace, 20 simulated cameras sending raw 128x128 RGB frames, phases
spread) at a steady rate well under the maximum, and while it runs records
each serving process with `perf record` (Debian's linux-perf) for a fixed
window. Each process's CPU time over the same window (from /proc) divided by
the frames due in it gives CPU-ms per frame; the samples, grouped by what
their symbol belongs to (ONNX Runtime, packet crypto, QUIC, the kernel's
UDP path, its sleeps and wake-ups, copies, allocation, the async runtime,
...), split it. The table goes to --markdown (docs/benchmarks.md,
"Where a frame's CPU goes") and every figure to --json.

perf needs kernel.perf_event_paranoid <= 1 (or root) to see the kernel's
share; the script says so and stops when it cannot record.
"""

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RELEASE = os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release")
CAMERAS = 20
TCK = os.sysconf("SC_CLK_TCK")

# First match wins: (what the time is for, test on (dso, symbol)).
CATEGORIES = [
    ("ONNX Runtime (inference)",
     lambda d, s: "onnxruntime" in d or s.startswith("Mlas") or "mlas" in s.lower()),
    ("TLS packet crypto (AES-GCM, header protection)",
     lambda d, s: "ring" in s or "aes" in s.lower() or "gcm" in s.lower() or "rustls" in s),
    ("QUIC (quinn-proto, quinn, quinn-udp)", lambda d, s: "quinn" in s),
    ("copies (memcpy, memmove, user copies)",
     lambda d, s: re.search(r"memcpy|memmove|copy_user|copyout|copyin|rep_movs", s) is not None),
    ("allocation (malloc, free)",
     lambda d, s: d != "[kernel.kallsyms]"
     and re.search(r"malloc|(^|_)free|cfree|realloc|calloc|_int_|tcache|unlink_chunk|consolidate", s) is not None),
    ("kernel: sleeping and waking threads (futex, epoll, context switches)",
     lambda d, s: d == "[kernel.kallsyms]"
     and re.search(r"futex|schedule|switch|epoll|wake|idle|pick_next|enqueue|dequeue|update_curr|"
                   r"ttwu|select_task|hrtimer|nanosleep|load_balance|cpuacct|psi_|spin_unlock", s) is not None),
    ("kernel: UDP/IP send and receive, other syscalls", lambda d, s: d == "[kernel.kallsyms]"),
    ("async runtime (tokio)", lambda d, s: "tokio" in s or "mio::" in s),
    ("preprocessing (worker: u8 to f32)", lambda d, s: "preprocess" in s or "ndarray" in s),
    ("scheduler (gateway)", lambda d, s: "scheduler" in s),
    ("wire codec, detections, results", lambda d, s: "tidegate_protocol" in s or "postprocess" in s or "detection" in s.lower()),
    ("metrics and logging", lambda d, s: "prometheus" in s or "tracing" in s or "hdrhistogram" in s),
    ("other tidegate code", lambda d, s: "tidegate" in s),
    ("other (libc, unresolved)", lambda d, s: True),
]


def say(msg):
    print(f"profile-frame: {msg}", file=sys.stderr, flush=True)


def cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def children(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    procs = {}
    for c in out.split():
        try:
            with open(f"/proc/{c}/comm") as f:
                procs[int(c)] = f.read().strip()
        except OSError:
            pass
    return procs


def report_rows(data):
    """(percent, dso, symbol) of each line of a flat `perf report`."""
    text = subprocess.run(
        ["perf", "report", "-i", data, "--stdio", "--no-children", "--sort", "dso,sym"],
        capture_output=True, text=True).stdout
    rows = []
    for line in text.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[[.k]\]\s+(.*)$", line)
        if m:
            rows.append((float(m.group(1)), m.group(2), m.group(3).strip()))
    return rows


def categorize(rows):
    shares = collections.OrderedDict((name, 0.0) for name, _ in CATEGORIES)
    for pct, dso, sym in rows:
        for name, test in CATEGORIES:
            if test(dso, sym):
                shares[name] += pct
                break
    return shares


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fps", type=float, default=700.0, help="total frames per second (all cameras)")
    p.add_argument("--warmup", type=float, default=14.0, help="seconds before recording starts")
    p.add_argument("--window", type=float, default=15.0, help="seconds recorded")
    p.add_argument("--json", default=os.path.join(ROOT, "target", "profile-frame.json"))
    p.add_argument("--markdown", default=os.path.join(ROOT, "target", "profile-frame.md"))
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="profile-frame-")
    seconds = int(a.warmup + a.window + 10)
    argv = [os.path.join(RELEASE, "tidegate-loadtest"), "--local", "--workers", "2", "--encoding", "raw",
            "--cameras", str(CAMERAS), "--fps", f"{a.fps / CAMERAS:.3f}", "--seconds", str(seconds),
            "--report", os.path.join(work, "report.json")]
    say(" ".join(argv))
    lt = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "loadtest.log"), "w"))
    try:
        time.sleep(a.warmup)
        procs = children(lt.pid)
        gateway = [pid for pid, comm in procs.items() if comm.startswith("tidegate-gatewa")]
        workers = [pid for pid, comm in procs.items() if comm.startswith("tidegate-worker")]
        if len(gateway) != 1 or len(workers) != 2:
            sys.exit(f"profile-frame: expected a gateway and 2 workers under the load test, found {procs}")
        groups = {"gateway": gateway, "workers": workers, "load generator": [lt.pid]}
        before = {g: sum(cpu_ticks(x) for x in pids) for g, pids in groups.items()}
        records = {}
        for g in ("gateway", "workers"):
            data = os.path.join(work, f"{g}.data")
            records[g] = (data, subprocess.Popen(
                ["perf", "record", "-F", "999", "-o", data, "-p", ",".join(map(str, groups[g])),
                 "--", "sleep", str(a.window)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        time.sleep(a.window)
        after = {g: sum(cpu_ticks(x) for x in pids) for g, pids in groups.items()}
        for g, (_, rec) in records.items():
            _, err = rec.communicate(timeout=60)
            if rec.returncode != 0:
                sys.exit(f"profile-frame: perf record failed for the {g} ({err.strip()[-400:]}); "
                         "install linux-perf and allow it: sysctl kernel.perf_event_paranoid=1")
    finally:
        lt.wait(timeout=seconds * 3 + 120)
    with open(os.path.join(work, "report.json")) as f:
        report = json.load(f)
    frames = a.fps * a.window
    result = {"fps": a.fps, "window_s": a.window, "report": {k: report.get(k) for k in
              ("planned", "ok_within_budget", "missing", "e2e_ms")}, "processes": {}}
    for g in groups:
        ms = (after[g] - before[g]) / TCK * 1000.0 / frames
        entry = {"cpu_ms_per_frame": ms}
        if g in records:
            rows = report_rows(records[g][0])
            entry["shares_percent"] = categorize(rows)
            entry["top_symbols"] = rows[:15]
        result["processes"][g] = entry
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"{CAMERAS} cameras, {a.fps:.0f} fps in all, raw frames, phases spread; "
             f"perf record -F 999 over {a.window:.0f} s; CPU from /proc over the same window. "
             f"The load generator (the simulated edge, not in the table) took "
             f"{result['processes']['load generator']['cpu_ms_per_frame']:.3f} CPU-ms per frame.",
             "",
             "| where | gateway (ms per frame) | workers, both (ms per frame) |",
             "|---|---|---|"]
    gw, wk = result["processes"]["gateway"], result["processes"]["workers"]
    for name, _ in CATEGORIES:
        g = gw["shares_percent"][name] * gw["cpu_ms_per_frame"] / 100
        w = wk["shares_percent"][name] * wk["cpu_ms_per_frame"] / 100
        if g >= 0.0005 or w >= 0.0005:
            lines.append(f"| {name} | {g:.3f} ({gw['shares_percent'][name]:.1f} %) "
                         f"| {w:.3f} ({wk['shares_percent'][name]:.1f} %) |")
    lines.append(f"| **all** | **{gw['cpu_ms_per_frame']:.3f}** | **{wk['cpu_ms_per_frame']:.3f}** |")
    with open(a.markdown, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    say(f"wrote {a.json} and {a.markdown}")


if __name__ == "__main__":
    main()
