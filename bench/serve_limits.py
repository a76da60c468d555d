"""`metainfer serve` against hostile clients: one huge request and a slowloris crowd, measured.

    python bench/serve_limits.py [--prompt-mb 50] [--sockets 200] [--seconds 20] [--max-request-bytes N]

1. A completion whose prompt is one word of `--prompt-mb` MB, sent with its Content-Length,
   while /health is probed every 100 ms: the answer's status and seconds, the probes' p50/p99
   latency (and how many went unanswered within 5 s), the server's RSS before, at its peak
   (sampled every 50 ms) and after; then the seconds SIGTERM takes to end the process.
2. `--sockets` connections that each send one byte of a request head per second (slowloris),
   held for `--seconds`, while ordinary completions (8 prompt tokens, 8 new) run one after
   another: their latency during the crowd and after it leaves.
Everything runs on 127.0.0.1 against hf-llama-tiny (random weights, aot_eager lowering).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _rss_sampler(pid: int, stop: threading.Event, out: list[int]) -> None:
    import psutil

    p = psutil.Process(pid)
    while not stop.is_set():
        try:
            out.append(p.memory_info().rss)
        except psutil.Error:
            return
        time.sleep(0.05)


def huge_request(server, mb: int) -> dict:
    import httpx
    import psutil

    proc = psutil.Process(server.proc.pid)
    before = proc.memory_info().rss
    name = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"].encode()
    body = b'{"model": "' + name + b'", "prompt": "' + b"w" * (mb * 2**20) + b'", "max_tokens": 4}'
    probes, missed, stop, rss = [], [0], threading.Event(), []

    def probe():
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                httpx.get(f"{server.url}/health", timeout=5)
                probes.append(time.perf_counter() - t0)
            except httpx.TransportError:
                missed[0] += 1
            stop.wait(0.1)

    threads = [threading.Thread(target=probe, daemon=True),
               threading.Thread(target=_rss_sampler, args=(server.proc.pid, stop, rss), daemon=True)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    t0 = time.perf_counter()
    r = httpx.post(f"{server.url}/v1/completions", content=body, headers={"Content-Type": "application/json"},
                   timeout=600)
    seconds = time.perf_counter() - t0
    time.sleep(1.0)  # probes after it, too
    stop.set()
    for t in threads:
        t.join()
    time.sleep(1.0)
    return {"status": r.status_code, "code": (r.json().get("error") or {}).get("code"), "seconds": round(seconds, 3),
            "health_p50_ms": round(_percentile(probes, 0.5) * 1e3, 1),
            "health_p99_ms": round(_percentile(probes, 0.99) * 1e3, 1), "health_probes": len(probes),
            "health_unanswered": missed[0], "rss_before_mb": round(before / 2**20),
            "rss_peak_mb": round(max(rss + [before]) / 2**20), "rss_after_mb": round(proc.memory_info().rss / 2**20)}


def slowloris(server, sockets: int, seconds: float) -> dict:
    import httpx

    port = server.port
    stop = threading.Event()
    conns = []
    for _ in range(sockets):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        conns.append(s)
    held = [0]

    def drip():
        while not stop.is_set():
            for s in list(conns):
                try:
                    s.sendall(b"X")
                except OSError:
                    conns.remove(s)
            held[0] = len(conns)
            stop.wait(1.0)

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    name = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": name, "prompt": list(range(3, 11)), "max_tokens": 8, "temperature": 0}

    def latencies(until: float) -> tuple[list[float], int]:
        out, failed = [], 0
        while time.perf_counter() < until:
            t0 = time.perf_counter()
            try:
                r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
                if r.status_code == 200:
                    out.append(time.perf_counter() - t0)
                else:
                    failed += 1
            except httpx.TransportError:
                failed += 1
        return out, failed

    during, failed_during = latencies(time.perf_counter() + seconds)
    still_held = held[0]
    stop.set()
    dripper.join()
    for s in conns:
        s.close()
    time.sleep(1.0)
    after, failed_after = latencies(time.perf_counter() + min(seconds, 10))
    return {"sockets": sockets, "sockets_still_open_at_end": still_held,
            "during_requests": len(during), "during_failed": failed_during,
            "during_p50_ms": round(statistics.median(during) * 1e3, 1) if during else None,
            "during_p99_ms": round(_percentile(during, 0.99) * 1e3, 1) if during else None,
            "after_requests": len(after), "after_failed": failed_after,
            "after_p50_ms": round(statistics.median(after) * 1e3, 1) if after else None,
            "after_p99_ms": round(_percentile(after, 0.99) * 1e3, 1) if after else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-mb", type=int, default=50)
    ap.add_argument("--sockets", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--max-request-bytes", type=int, help="the server's body limit (default: its own); raise it "
                    "past the prompt to measure parsing and the character bound off the event loop instead")
    ap.add_argument("--skip-slowloris", action="store_true")
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args(argv)
    from metainfer.testing import ServerProcess, tiny_model_folder

    tmp = tempfile.mkdtemp(prefix="metainfer-limits-")
    folder = tiny_model_folder(os.path.join(tmp, "model"))
    extra = ["--max-request-bytes", str(a.max_request_bytes)] if a.max_request_bytes else []
    server = ServerProcess(folder, tmp, "--max-running", "4", "--max-queue", "4", *extra)
    result = {}
    try:
        result["huge_request"] = huge_request(server, a.prompt_mb)
        print("huge request:", json.dumps(result["huge_request"]), flush=True)
        if not a.skip_slowloris:
            result["slowloris"] = slowloris(server, a.sockets, a.seconds)
            print("slowloris:", json.dumps(result["slowloris"]), flush=True)
    finally:
        t0 = time.perf_counter()
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGTERM)
        rc = server.proc.wait(timeout=120)
        result["shutdown"] = {"rc": rc, "seconds": round(time.perf_counter() - t0, 2)}
        print("shutdown:", json.dumps(result["shutdown"]), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
