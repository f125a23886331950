#!/usr/bin/env python3
"""make bench-peers: tidegate against the inference servers users know, on
this machine, with the same model, the same open-loop load and the same SLO.

Every system serves BlazeFace (models/blazeface) on ONNX Runtime 1.31.1 CPU:

  tidegate   gateway + 2 workers x 1 intra-op thread, driven over QUIC by
             `tidegate-loadtest --local` (its own simulated cameras)
  baseline   tidegate-baseline: the same ORT sessions behind the simplest
             HTTP server (2 sessions x 1 thread, no batching)
  fastapi    FastAPI + onnxruntime, 2 uvicorn workers x 1 thread
  triton     NVIDIA Triton (PyTriton), python backend + onnxruntime,
             dynamic batching, 2 instances x 1 thread

The peers speak KServe v2 with binary tensors and are driven by
`tidegate-loadtest kserve`, the same open-loop schedule (20 cameras, phases
spread; --aligned: all in step) and the same accounting. For each system
the total rate is ramped (x1.25 while >= 99 % of planned frames are ok
within 80 ms, then bisected twice) to its maximum within the SLO; the ramp
is repeated (--repeats) and the spread reported. Then one run at half of
that maximum gives p50/p99 and the servers' CPU seconds per 1,000 frames;
peak RSS is the servers' largest VmHWM over all runs. The raw ONNX Runtime
limit (in process, same threads, batch 4) closes the table.

usage: scripts/bench-peers.py [--systems tidegate,baseline,fastapi,triton]
         [--seconds 15] [--repeats 2] [--aligned] [--json out] [--markdown out]
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RELEASE = os.path.join(ROOT, "target", "release")
MODEL_DIR = os.path.join(ROOT, "models", "blazeface")
PEERS = os.path.join(ROOT, "loadtest", "peers")
CAMERAS = 20
SLO_MS = 80
GOAL = 0.99
CLK_TCK = os.sysconf("SC_CLK_TCK")
# How tidegate's simulated cameras send frames (--tidegate-encoding).
ENCODING = "raw"


def say(msg):
    print(f"\033[1mbench-peers:\033[0m {msg}", file=sys.stderr, flush=True)


# Process tree accounting ------------------------------------------------------

def children(pid):
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def tree(pid):
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.append(p)
            todo += children(p)
    return seen


def cpu_s(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


def hwm_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class Meter:
    """Samples the CPU seconds and peak RSS of the server processes (found
    under `roots`, minus `exclude`) every 200 ms until stopped."""

    def __init__(self, roots, exclude=()):
        self.roots, self.exclude = roots, set(exclude)
        self.cpu, self.hwm, self.start_cpu = {}, {}, {}
        self.stop_flag = threading.Event()
        self.sample(first=True)
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def pids(self):
        out = []
        for r in self.roots():
            out += [p for p in tree(r) if p not in self.exclude]
        return out

    def sample(self, first=False):
        for p in self.pids():
            c, h = cpu_s(p), hwm_kib(p)
            if c is not None:
                if first or p not in self.start_cpu:
                    self.start_cpu.setdefault(p, c if first else 0.0)
                self.cpu[p] = c
            if h is not None:
                self.hwm[p] = max(self.hwm.get(p, 0), h)

    def run(self):
        while not self.stop_flag.wait(0.2):
            self.sample()

    def finish(self):
        self.stop_flag.set()
        self.thread.join()
        self.sample()
        used = sum(self.cpu[p] - self.start_cpu.get(p, 0.0) for p in self.cpu)
        return used, sum(self.hwm.values()) / 1024.0


# Systems ------------------------------------------------------------------------

def peers_python():
    out = subprocess.run(["bash", os.path.join(PEERS, "setup.sh")], check=True,
                         stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()
    return out[-1]


def wait_ready(url, proc, timeout=120):
    import urllib.request
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            # The model's readiness: Triton's server is ready before its model.
            with urllib.request.urlopen(f"{url}/v2/models/blazeface/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready within {timeout} s")


class Server:
    def __init__(self, name, argv, port, env=None):
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"peer-{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        try:
            wait_ready(self.url, self.proc)
        except Exception:
            self.stop()
            raise RuntimeError(f"{name} did not start; log: {self.log.name}")

    def stop(self):
        """SIGTERM to the server's process group, then, after 10 s or once
        the server itself has gone, SIGKILL to whatever of the group is left
        (Triton's server and stubs outlive PyTriton's python otherwise)."""
        group = self.proc.pid
        try:
            os.killpg(group, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        end = time.time() + 10
        while time.time() < end and group_alive(group):
            time.sleep(0.2)
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def group_alive(pgid):
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    return True
            except (OSError, IndexError, ValueError):
                pass
    return False


def start_peer(name, python, port):
    if name == "baseline":
        return Server(name, [os.path.join(RELEASE, "tidegate-baseline"), "--model-dir", MODEL_DIR,
                             "--sessions", "2", "--threads", "1", "--port", str(port)], port)
    if name == "fastapi":
        return Server(name, [python, os.path.join(PEERS, "fastapi_server.py"), "--model-dir", MODEL_DIR,
                             "--port", str(port), "--workers", "2", "--threads", "1"], port)
    if name == "triton":
        libdir = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
                                check=True, stdout=subprocess.PIPE, text=True).stdout.strip()
        # Debian 12: the python backend's stub needs the interpreter's libpython.
        env = {"LD_LIBRARY_PATH": ":".join(filter(None, [libdir, os.environ.get("LD_LIBRARY_PATH")]))}
        return Server(name, [python, os.path.join(PEERS, "triton_server.py"), "--model-dir", MODEL_DIR,
                             "--port", str(port), "--instances", "2", "--threads", "1"], port, env)
    raise ValueError(name)


def run_point(system, server, total_fps, seconds, aligned):
    """One open-loop run at `total_fps`; returns the report plus the servers' CPU and RSS."""
    fps = total_fps / CAMERAS
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        report_path = f.name
    common = ["--cameras", str(CAMERAS), "--fps", f"{fps:.3f}", "--seconds", str(seconds),
              "--report", report_path]
    if aligned:
        common.append("--in-step")
    loadtest = os.path.join(RELEASE, "tidegate-loadtest")
    if system == "tidegate":
        # Raw u8 frames, as the peers get them (tidegate's edge sends JPEG
        # by default: --tidegate-encoding jpeg).
        argv = [loadtest, "--local", "--workers", "2", "--encoding", ENCODING] + common
    else:
        argv = [loadtest, "kserve", "--url", server.url, "--model", "blazeface",
                "--system", system] + common
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if system == "tidegate":
        # The servers are the loadtest's children (gateway, workers); the
        # simulated cameras run in the loadtest process itself.
        meter = Meter(lambda: children(proc.pid), exclude=[proc.pid])
    else:
        meter = Meter(lambda: [server.proc.pid])
    _, err = proc.communicate(timeout=seconds * 4 + 180)
    cpu, rss = meter.finish()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{err[-3000:]}")
    with open(report_path) as f:
        report = json.load(f)
    os.unlink(report_path)
    planned = report.get("planned") or report.get("sent")
    ok = report["ok_within_budget"]
    return {
        "total_fps": total_fps,
        "planned": planned,
        "ok_within_budget": ok,
        "attainment": ok / planned if planned else 0.0,
        "p50_ms": report["e2e_ms"]["p50"],
        "p99_ms": report["e2e_ms"]["p99"],
        "server_cpu_s": cpu,
        "server_rss_mib": rss,
    }


def ramp(system, server, seconds, aligned, start):
    """The highest total rate whose run keeps >= GOAL of planned frames ok within the SLO."""
    points, good, bad, rate = [], None, None, start
    for _ in range(40):
        p = run_point(system, server, rate, seconds, aligned)
        points.append(p)
        say(f"{system}: {rate:.0f} fps -> {100 * p['attainment']:.1f} % ok within {SLO_MS} ms")
        if p["attainment"] >= GOAL:
            good = rate
            if bad is None:
                rate *= 1.25
                continue
        else:
            bad = rate
            if good is None:
                rate /= 1.6
                if rate < 5:
                    break
                continue
        if bad is not None and good is not None:
            if bad / good < 1.06:
                break
            rate = (good + bad) / 2
    return good or 0.0, points


def raw_ort_limit(python, seconds):
    code = r"""
import sys, threading, time, numpy as np, onnxruntime as ort
path, secs = sys.argv[1], float(sys.argv[2])
done = [0] * 2
def run(i):
    o = ort.SessionOptions(); o.intra_op_num_threads = 1; o.inter_op_num_threads = 1
    s = ort.InferenceSession(path, o, providers=["CPUExecutionProvider"])
    x = np.zeros((4, 128, 128, 3), np.float32); names = [t.name for t in s.get_outputs()]
    inp = s.get_inputs()[0].name
    s.run(names, {inp: x})
    end = time.time() + secs
    while time.time() < end:
        s.run(names, {inp: x}); done[i] += 4
ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
t0 = time.time(); [t.start() for t in ts]; [t.join() for t in ts]
print(sum(done) / (time.time() - t0))
"""
    out = subprocess.run([python, "-c", code, os.path.join(MODEL_DIR, "model.onnx"), str(seconds)],
                         check=True, stdout=subprocess.PIPE, text=True).stdout
    return float(out.strip().splitlines()[-1])


def markdown(results, raw, seconds, repeats, aligned):
    shape = "all cameras in step" if aligned else "camera phases spread"
    shape += f"; tidegate's cameras send {ENCODING} frames"
    lines = [
        f"{CAMERAS} cameras, open loop, {shape}; {seconds} s a point, ramp repeated {repeats}x; "
        f"SLO: >= 99 % of planned frames ok within {SLO_MS} ms. CPU and RSS are the serving processes' "
        f"(not the load generator's).",
        "",
        "| system | max fps within SLO (runs) | vs Triton | p50 / p99 at half load (ms) | CPU-s per 1k frames | peak RSS (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    triton = results.get("triton", {}).get("max_fps")
    for name, r in results.items():
        runs = ", ".join(f"{m:.0f}" for m in r["maxima"])
        vs = f"{r['max_fps'] / triton:.2f}x" if triton else "—"
        half = r.get("half") or {}
        cpu = (f"{1000 * half['server_cpu_s'] / half['planned']:.2f}" if half.get("planned") else "—")
        lat = f"{half['p50_ms']:.1f} / {half['p99_ms']:.1f}" if half else "—"
        lines.append(f"| {name} | {r['max_fps']:.0f} ({runs}) | {vs} | {lat} | {cpu} | {r['peak_rss_mib']:.0f} |")
    if raw:
        lines.append(f"| raw ONNX Runtime in process (2 sessions x 1 thread, batch 4) | {raw:.0f} | "
                     f"{raw / triton:.2f}x | — | — | — |" if triton else
                     f"| raw ONNX Runtime in process (2 sessions x 1 thread, batch 4) | {raw:.0f} | — | — | — | — |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", default="tidegate,baseline,fastapi,triton")
    p.add_argument("--seconds", type=int, default=15)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--aligned", action="store_true")
    p.add_argument("--tidegate-encoding", default="raw", choices=["raw", "jpeg", "png"],
                   help="how tidegate's simulated cameras send frames (the peers get raw)")
    p.add_argument("--start", type=float, default=160.0, help="first total rate of each ramp")
    p.add_argument("--json", default=os.path.join(ROOT, "target", "bench-peers.json"))
    p.add_argument("--markdown", default=os.path.join(ROOT, "target", "bench-peers.md"))
    a = p.parse_args()
    global ENCODING
    ENCODING = a.tidegate_encoding
    systems = [s for s in a.systems.split(",") if s]
    # The peers' venv also runs the raw ONNX Runtime limit.
    python = peers_python()
    results, port = {}, 18000
    for system in systems:
        server = None
        try:
            if system != "tidegate":
                say(f"starting {system}")
                server = start_peer(system, python, port)
                port += 10
            maxima, all_points = [], []
            for i in range(a.repeats):
                best, points = ramp(system, server, a.seconds, a.aligned, a.start)
                maxima.append(best)
                all_points += points
            best = sorted(maxima)[len(maxima) // 2] if maxima else 0.0
            half = run_point(system, server, max(best / 2, 10.0), a.seconds, a.aligned) if best else None
            if half:
                all_points.append(half)
            results[system] = {
                "max_fps": best,
                "maxima": maxima,
                "half": half,
                "peak_rss_mib": max(pt["server_rss_mib"] for pt in all_points),
                "points": all_points,
            }
        finally:
            if server:
                server.stop()
    raw = raw_ort_limit(python, max(a.seconds, 10)) if python else None
    with open(a.json, "w") as f:
        json.dump({"aligned": a.aligned, "seconds": a.seconds, "results": results, "raw_ort_fps": raw}, f, indent=2)
    with open(a.markdown, "w") as f:
        f.write(markdown(results, raw, a.seconds, a.repeats, a.aligned))
    say(f"wrote {a.json} and {a.markdown}")


if __name__ == "__main__":
    main()
