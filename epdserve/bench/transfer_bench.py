"""Handoff bandwidth of each EC connector and each KV connector (the same transport under the KV
signing key), next to the two bounds that matter: a plain memcpy (what shm can at best approach)
and a raw loopback socket (what tcp can at best approach).

Producer and consumer run in separate processes. "handoff" is the time from the producer's put
starting to the consumer holding the validated tensor (the handle travels over a pipe, as it would
inside a request); "get" is the consumer's part alone. Each figure is the median of a few repeats
after one warm-up, so shm numbers are for a reused slab region.

    python -m epdserve.bench.transfer_bench [--sizes-mb 1 16 128] [--repeats 5] [--kv-connectors shm tcp]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import secrets
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from multiprocessing.connection import Connection

import numpy as np
import torch

from epdserve.transfer.config import ECConfig
from epdserve.transfer.factory import make_consumer, make_producer
from epdserve.transfer.kv import kv_config

MB = 1 << 20
WIDTH = 1024  # float32 columns: 4 KiB rows
MODEL = "bench-model"
SOCKET_CHUNK = 4 << 20


def _rows(nbytes: int) -> int:
    return nbytes // (WIDTH * 4)


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def _producer_main(conn: Connection, cfg: ECConfig, sizes: list[int]) -> None:
    """Child process: put one tensor per request and send back (put start, put end, handle)."""
    torch.set_num_threads(1)
    producer = make_producer(cfg)
    tensors = {n: torch.randn(_rows(n), WIDTH) for n in sizes}
    conn.send("ready")
    while (size := conn.recv()) is not None:
        start = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
        handle = producer.put("bench", tensors[size], MODEL)
        conn.send((start, time.perf_counter(), handle))
    producer.close()


async def _consume(conn: Connection, cfg: ECConfig, sizes: list[int], repeats: int) -> dict[str, dict[int, float]]:
    consumer = make_consumer(cfg)
    handoff: dict[int, float] = {}
    get: dict[int, float] = {}
    put: dict[int, float] = {}
    for size in sizes:
        spans: dict[str, list[float]] = {"handoff": [], "get": [], "put": []}
        for attempt in range(repeats + 1):
            conn.send(size)
            start, put_end, handle = conn.recv()
            got_start = time.perf_counter()
            tensor = await consumer.get(handle, _rows(size), WIDTH, MODEL)
            done = time.perf_counter()
            await consumer.release(handle)
            del tensor
            if attempt:  # the first is a warm-up
                spans["handoff"].append(done - start)
                spans["get"].append(done - got_start)
                spans["put"].append(put_end - start)
        handoff[size] = _gbps(size, spans["handoff"])
        get[size] = _gbps(size, spans["get"])
        put[size] = _gbps(size, spans["put"])
    await consumer.close()
    return {"handoff": handoff, "put": put, "get": get}


def bench_connector(cfg: ECConfig, sizes: list[int], repeats: int) -> dict[str, dict[int, float]]:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_producer_main, args=(theirs, cfg, sizes), daemon=True)
    child.start()
    try:
        if ours.recv() != "ready":
            raise RuntimeError("the producer process did not start")
        return asyncio.run(_consume(ours, cfg, sizes, repeats))
    finally:
        ours.send(None)
        child.join(timeout=30)


def bench_memcpy(sizes: list[int], repeats: int) -> dict[str, dict[int, float]]:
    fresh: dict[int, float] = {}
    warm: dict[int, float] = {}
    for size in sizes:
        src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
        dst = torch.empty(size, dtype=torch.uint8)
        dst.fill_(1)
        fresh[size] = _gbps(size, timed(src.copy, repeats))
        warm[size] = _gbps(size, timed(partial(dst.copy_, torch.from_numpy(src)), repeats))
    return {"numpy copy (fresh dst)": fresh, "torch copy_ (warm dst)": warm}


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    """The wall time of each of ``repeats`` calls of ``fn``, after one untimed call."""
    fn()
    spans = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        spans.append(time.perf_counter() - start)
    return spans


def _socket_sender(port: int, sizes: list[int], repeats: int) -> None:
    """Child process: for every go byte, send the next payload in chunks."""
    payloads = {n: np.ones(n, dtype=np.uint8) for n in sizes}
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for size in sizes:
            view = memoryview(payloads[size].data)
            for _ in range(repeats + 1):
                sock.recv(1)
                for start in range(0, size, SOCKET_CHUNK):
                    sock.sendall(view[start : start + SOCKET_CHUNK])


def bench_loopback(sizes: list[int], repeats: int) -> dict[int, float]:
    """A raw loopback socket between two processes, received chunked into a preallocated buffer."""
    result: dict[int, float] = {}
    with socket.create_server(("127.0.0.1", 0)) as server:
        ctx = mp.get_context("spawn")
        child = ctx.Process(target=_socket_sender, args=(server.getsockname()[1], sizes, repeats), daemon=True)
        child.start()
        conn, _ = server.accept()
        with conn:
            for size in sizes:
                buf = np.empty(size, dtype=np.uint8)
                view = memoryview(buf.data)
                spans = []
                for attempt in range(repeats + 1):
                    start = time.perf_counter()
                    conn.sendall(b"g")
                    got = 0
                    while got < size:
                        k = conn.recv_into(view[got : got + SOCKET_CHUNK])
                        if k == 0:
                            raise RuntimeError("the sender closed early")
                        got += k
                    if attempt:
                        spans.append(time.perf_counter() - start)
                result[size] = _gbps(size, spans)
        child.join(timeout=30)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--connectors", nargs="+", default=["shm", "tcp", "fs"])
    parser.add_argument("--kv-connectors", nargs="*", default=["shm", "tcp"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = [mb * MB for mb in args.sizes_mb]
    base = ECConfig(
        shm_bytes=max(256 * MB, 2 * max(sizes) + MB), tcp_bytes=4 * max(sizes), secret=secrets.token_hex(32)
    )

    rows: list[tuple[str, dict[int, float]]] = []
    for name, by_size in bench_memcpy(sizes, args.repeats).items():
        rows.append((f"memcpy: {name}", by_size))
    rows.append(("loopback socket, 2 processes, chunked recv_into", bench_loopback(sizes, args.repeats)))
    with tempfile.TemporaryDirectory(prefix="epd-ec-bench-") as fs_dir:
        for kind in args.connectors:
            cfg = replace(base, connector=kind, fs_dir=fs_dir)
            for what, by_size in bench_connector(cfg, sizes, args.repeats).items():
                rows.append((f"{kind}: {what}", by_size))
        for kind in args.kv_connectors:
            cfg = kv_config(base, kind, "bench-kv", "float32")
            for what, by_size in bench_connector(cfg, sizes, args.repeats).items():
                rows.append((f"KV {kind}: {what}", by_size))

    print(f"\nEC and KV handoff bandwidth, GB/s (median of {args.repeats}; float32 [rows, {WIDTH}])\n")
    print("| path | " + " | ".join(f"{mb} MB" for mb in args.sizes_mb) + " |")
    print("|---|" + "---:|" * len(sizes))
    for label, by_size in rows:
        print(f"| {label} | " + " | ".join(f"{by_size[n]:.2f}" for n in sizes) + " |")


if __name__ == "__main__":
    main()
