"""Faults of `metainfer serve --ranks 2`, and how the server ends: how long after the fault
the clients in flight got their errors (and what the errors said), the server's exit status and
when it came, and what was left behind (rank processes, zombies, files in /dev/shm).

    python bench/serve_faults.py [--model hf-llama-tiny] [--json F]

Faults (rank 1 of 2 unless said; HF Llama tiny, aot_eager, --step-timeout 2): killed (SIGKILL)
mid-decode; hung (SIGSTOP: the process stops answering); raising in its engine loop (rank 1, and
rank 0), or stuck in it while the process answers (METAINFER_SERVE_FAULT=raise@R / hang@1,
fired by SIGUSR2); one that cannot start (METAINFER_SERVE_FAULT=start@1). Three streamed requests of 400 tokens are in
flight when a fault hits.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time

import httpx
import psutil

from metainfer.testing import ServerProcess

FAULTS = {  # name: (what is done to the rank, METAINFER_SERVE_FAULT, the rank)
    "killed mid-decode (SIGKILL)": ("kill", None, 1),
    "hung (SIGSTOP)": ("stop", None, 1),
    "raises in its engine loop": ("usr2", "raise@1", 1),
    "stuck in its engine loop (--step-timeout 2)": ("usr2", "hang@1", 1),
    "rank 0 raises in its engine loop": ("usr2", "raise@0", 0),
    "cannot start": (None, "start@1", 1),
}


def _stream(url: str, out: dict, prompt: list[int]) -> None:
    body = {"model": "m", "prompt": prompt, "max_tokens": 400, "temperature": 0, "stream": True}
    tokens, last = 0, None
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                out.update(status=r.status_code, error=json.loads(r.read())["error"]["message"], at=time.monotonic())
                return
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.update(status="error event", error=event["error"]["message"], at=time.monotonic())
                    return
                tokens += len(event["choices"][0].get("token_ids", []))
                out["tokens"] = tokens
                last = event["choices"][0].get("finish_reason")
        out.update(status="finished" if last else "stream ended", at=time.monotonic())
    except httpx.HTTPError as e:
        out.update(status=f"transport error ({type(e).__name__})", at=time.monotonic())


def run_fault(name: str, model: str, tmp: str) -> dict:
    action, env, rank = FAULTS[name]
    before_shm = set(os.listdir("/dev/shm"))
    extra = {"METAINFER_SERVE_FAULT": env} if env else {}
    args = ("--ranks", "2", "--num-blocks", "256", "--grace", "10", "--served-model-name", "m", "--step-timeout", "2")
    started = time.monotonic()
    if action is None:  # it must not become ready: time its exit
        server = ServerProcess(model, tmp, *args, env=extra, wait=False)
        code = server.proc.wait(timeout=600)
        ranks = server.rank_pids
        return {"fault": name, "clients": [], "exit_status": code, "exit_after_s": round(time.monotonic() - started, 1),
                "message": _error_line(server.tail(None)), "left_behind": _leftovers(before_shm, ranks)}
    server = ServerProcess(model, tmp, *args, env=extra)
    ranks = server.rank_pids
    clients = [{} for _ in range(3)]
    threads = [threading.Thread(target=_stream, args=(server.url, c, [5 + i, 6, 7, 8])) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while not all(c.get("tokens", 0) >= 8 for c in clients) and time.monotonic() < deadline:
        time.sleep(0.02)
    victim = ranks[rank]
    fault_at = time.monotonic()
    os.kill(victim, {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "usr2": signal.SIGUSR2}[action])
    for t in threads:
        t.join(timeout=120)
    code = server.proc.wait(timeout=120)
    exited = time.monotonic()
    return {"fault": name, "exit_status": code, "exit_after_s": round(exited - fault_at, 2),
            "clients": [{"tokens_before": c.get("tokens"), "status": c.get("status"),
                         "error_after_s": round(c["at"] - fault_at, 2) if "at" in c else None,
                         "error": (c.get("error") or "")[:160]} for c in clients],
            "message": _error_line(server.tail(None)), "left_behind": _leftovers(before_shm, ranks)}


def _error_line(log: str) -> str:
    lines = [line for line in log.splitlines() if line.startswith("metainfer: error:")]
    return lines[-1][:240] if lines else ""


def _leftovers(before_shm: set, pids: list[int]) -> list[str]:
    time.sleep(0.5)
    found = []
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    if alive:
        found.append(f"processes alive: {alive}")
    zombies = [p.pid for p in psutil.Process().children(recursive=True) if p.status() == psutil.STATUS_ZOMBIE]
    if zombies:
        found.append(f"zombies: {zombies}")
    shm = set(os.listdir("/dev/shm")) - before_shm
    if shm:
        found.append(f"new files in /dev/shm: {sorted(shm)[:5]}")
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="hf-llama-tiny")
    ap.add_argument("--faults", nargs="+", choices=list(FAULTS), default=list(FAULTS))
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args(argv)
    rows = []
    for name in a.faults:
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(run_fault(name, a.model, tmp))
        r = rows[-1]
        print(f"{r['fault']}: exit {r['exit_status']} after {r['exit_after_s']} s; left behind: "
              f"{r['left_behind'] or 'nothing'}", flush=True)
        for c in r["clients"]:
            print(f"    client: {c['tokens_before']} tokens, then {c['status']} after {c['error_after_s']} s: {c['error']}")
        print(f"    server: {r['message']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
