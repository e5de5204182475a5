"""Start ``heron serve`` from one or more source trees and record a concurrency curve of each.

    python benchmarks/serve_curve.py --source main=/path/to/main --source new=.
    python benchmarks/serve_curve.py --source new=. --api-server-counts 1,2

For every source (``NAME=DIR``: the tree whose ``heron`` package runs the server), every number
of HTTP front processes (``--api-server-count`` of ``heron serve``; 1 passes no flag, so older
trees run too) and every concurrency it runs ``2 x concurrency`` streaming completions (``benchmarks/serve.py``'s
client, temperature 0, ``ignore_eos``) and prints one markdown table: output tok/s and TTFT
p50 per concurrency. The client is spread over several processes so that its own parsing does
not cap what a fast server can show.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
from serve import Result, measure, percentiles

ROUNDS = 2  # requests per stream slot at each concurrency


def _client(base_url: str, num_requests: int, concurrency: int, max_tokens: int):
    """One client process's share: (start, end, results); monotonic times, one clock for all."""
    start = time.monotonic()
    results, _ = asyncio.run(measure(base_url, None, None, num_requests, concurrency, max_tokens))
    return start, time.monotonic(), results


def curve_point(
    pool: ProcessPoolExecutor, base_url: str, concurrency: int, max_tokens: int, processes: int
) -> tuple[float, float, int]:
    """Output tok/s, TTFT p50 (s) and failed requests at ``concurrency`` streams."""
    processes = min(processes, concurrency)
    shares = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    futures = [
        pool.submit(_client, base_url, ROUNDS * share, share, max_tokens) for share in shares
    ]
    parts = [f.result() for f in futures]
    results: list[Result] = [r for _, _, rs in parts for r in rs]
    elapsed = max(end for _, end, _ in parts) - min(start for start, _, _ in parts)
    ok = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    return tokens / elapsed, percentiles([r.ttft for r in ok])[0], len(results) - len(ok)


def start_server(source: Path, port: int, fronts: int, extra: list[str]) -> subprocess.Popen:
    # The source tree is the working directory: `python -m` puts it first on sys.path.
    path = os.pathsep.join(filter(None, [str(source), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "heron.cli", "serve", "--port", str(port), *extra]
    if fronts > 1:
        cmd += ["--api-server-count", str(fronts)]
    proc = subprocess.Popen(cmd, cwd=source, env=env)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server from {source} exited with code {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server from {source} did not become healthy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", action="append", required=True, help="NAME=DIR")
    parser.add_argument("--concurrency", default="1,16,64,256,512")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--client-processes", type=int, default=8)
    parser.add_argument("--port", type=int, default=8321)
    parser.add_argument("--server-arg", action="append", default=[], help="passed to serve")
    parser.add_argument("--api-server-counts", default="1", help="front processes, e.g. 1,2")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    counts = [int(c) for c in args.api_server_counts.split(",")]
    base_url = f"http://127.0.0.1:{args.port}"
    rows = []
    with ProcessPoolExecutor(args.client_processes) as pool:
        for source in args.source:
            name, _, folder = source.partition("=")
            for fronts in counts:
                proc = start_server(Path(folder).resolve(), args.port, fronts, args.server_arg)
                try:
                    curve_point(pool, base_url, 16, 16, args.client_processes)  # warm-up
                    for level in levels:
                        tok_s, ttft, failed = curve_point(
                            pool, base_url, level, args.max_tokens, args.client_processes
                        )
                        rows.append((name, fronts, level, tok_s, ttft, failed))
                        print(
                            f"{name} x{fronts} {level}: {tok_s:.0f} tok/s, TTFT p50 {ttft:.3f} s",
                            flush=True,
                        )
                finally:
                    proc.terminate()
                    proc.wait(60)
    print(f"\nmax_tokens {args.max_tokens}, {ROUNDS} x concurrency requests per point\n")
    print("| server | fronts | streams | output tok/s | TTFT p50 (s) | failed |")
    print("|---|---|---|---|---|---|")
    for name, fronts, level, tok_s, ttft, failed in rows:
        print(f"| {name} | {fronts} | {level} | {tok_s:.0f} | {ttft:.3f} | {failed} |")


if __name__ == "__main__":
    main()
