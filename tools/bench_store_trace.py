#!/usr/bin/env python3
"""Prefix reuse across processes through a shared Redis (docs/KV_STORE.md).

A trace of requests whose prompts share prefixes (a few long system
prompts, each followed by a distinct user part) is served two ways:

  single  one engine process serves the whole trace: its own prefix cache
          gives the hits;
  pair    two engine processes, each with the same Redis attached
          (write-through), get the requests in turn (A, B, A, B, ...):
          hits come from each one's prefix cache and from the store.

Reports the prompt tokens not computed (prefix cache + store) in each and
their ratio pair / single (goal >= 0.95). Requests run one at a time, and
a process flushes its writes before answering, so the next request (in the
other process) can find them: the ordering a trace sent in turn gives.

  python3 tools/bench_store_trace.py [--model PATH] [--redis URL]
      [--requests 32] [--system 4] [--system-len 512] [--user-len 64,256]
      [--gen 8] [--threads 2] [--seed 0] [--json]

Without --redis a throw-away redis-server is started on a Unix socket.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))


def worker(args) -> None:
    """One engine process: JSON requests on stdin, JSON results on stdout."""
    import kvcache
    from kvcache.model import Engine, Model

    model = Model(args.model)
    store = kvcache.KVStore(args.redis) if args.redis else None
    eng = Engine(model, num_threads=args.threads, kv_store=store)
    for line in sys.stdin:
        req = json.loads(line)
        before = eng.stats()
        rid = eng.add_request(req["prompt"], args.gen, ignore_eos=True)
        t0 = time.perf_counter()
        out = eng.run()[rid]
        dt = time.perf_counter() - t0
        if store is not None:
            store.flush(60)
        after = eng.stats()
        print(json.dumps({
            "tokens": out,
            "cached": after["cached_tokens"] - before["cached_tokens"],
            "external": after["external_tokens"] - before["external_tokens"],
            "seconds": dt,
        }), flush=True)
    eng.close()
    if store is not None:
        store.close()
    model.close()


def make_trace(args, n_vocab: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(args.seed)
    systems = [rng.integers(1, n_vocab, size=args.system_len).tolist()
               for _ in range(args.system)]
    lo, hi = args.user_len
    trace = []
    for _ in range(args.requests):
        s = systems[int(rng.integers(0, args.system))]
        trace.append(s + rng.integers(1, n_vocab, size=int(rng.integers(lo, hi + 1))).tolist())
    return trace


def start_worker(args, redis_url: str | None) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--worker", "--model", args.model, "--gen", str(args.gen),
           "--threads", str(args.threads)]
    if redis_url:
        cmd += ["--redis", redis_url]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def ask(p: subprocess.Popen, prompt: list[int]) -> dict:
    p.stdin.write(json.dumps({"prompt": prompt}) + "\n")
    p.stdin.flush()
    line = p.stdout.readline()
    if not line:
        raise SystemExit("bench_store_trace: a worker died")
    return json.loads(line)


def stop(p: subprocess.Popen) -> None:
    p.stdin.close()
    p.wait(timeout=60)


def start_redis(tmp: str) -> tuple[subprocess.Popen, str]:
    server = shutil.which("redis-server")
    if not server:
        raise SystemExit("bench_store_trace: redis-server not found (Debian: redis-server)")
    sock = os.path.join(tmp, "redis.sock")
    p = subprocess.Popen([server, "--unixsocket", sock, "--unixsocketperm", "700", "--port", "0",
                          "--save", "", "--appendonly", "no", "--dir", tmp],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        if os.path.exists(sock):
            return p, "unix://" + sock
        time.sleep(0.05)
    p.kill()
    raise SystemExit("bench_store_trace: redis-server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--redis", default=None)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--system", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--user-len", type=lambda s: tuple(int(x) for x in s.split(",")),
                    default=(64, 256))
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    from kvcache.model import Model

    with Model(args.model) as m:
        trace = make_trace(args, m.n_vocab)
    tmp = tempfile.mkdtemp(prefix="kvc-trace-")
    redis_proc = None
    try:
        url = args.redis
        if not url:
            redis_proc, url = start_redis(tmp)
        single = start_worker(args, None)
        pair = [start_worker(args, url), start_worker(args, url)]
        s_hit = p_hit = p_ext = total = 0
        same = True
        for i, prompt in enumerate(trace):
            a = ask(single, prompt)
            b = ask(pair[i % 2], prompt)
            same &= a["tokens"] == b["tokens"]
            total += len(prompt)
            s_hit += a["cached"]
            p_hit += b["cached"] + b["external"]
            p_ext += b["external"]
        for p in [single] + pair:
            stop(p)
    finally:
        if redis_proc:
            redis_proc.kill()
            redis_proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    ratio = p_hit / s_hit if s_hit else 0.0
    res = {"requests": len(trace), "prompt_tokens": total, "single_hit_tokens": s_hit,
           "pair_hit_tokens": p_hit, "pair_store_tokens": p_ext, "ratio": round(ratio, 4),
           "same_tokens": same}
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{len(trace)} requests, {total} prompt tokens: one process reused {s_hit}, two "
              f"processes sharing Redis {p_hit} ({p_ext} from the store): ratio {ratio:.3f} "
              f"(goal >= 0.95); outputs {'identical' if same else 'DIFFER'}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
