"""What one engine step's message costs each side of server.engine_process, in CPU time.

    python -m bench.serve_wire [--streams 64] [--reps 3000]

A decode step of N streams (one token, five characters each): the engine process's side (its
EngineLoop's dispatch into the outbox: compact tuples, one pickled frame, one write on a pipe
another thread drains) and the server's side (frames, unpickle, N StreamDeltas into N asyncio
queues on the reading event loop), beside the in-process EngineLoop's dispatch of the same step
(metrics, one call_soon_threadsafe, the deliveries on the event loop). thread_time, so a loaded
machine reads the same.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import threading
import time

import numpy as np

from metrale import driver
from metrale.outputs import StreamDelta
from metrale.server.engine_child import _Outbox, _Sink
from metrale.server.engine_process import _HEADER, ProcessLoop, _frames, _Remote


def cpu_us(fn, reps: int) -> float:
    fn()
    t0 = time.thread_time()
    for _ in range(reps):
        fn()
    return (time.thread_time() - t0) / reps * 1e6


def step_deltas(n: int) -> list[StreamDelta]:
    return [StreamDelta(f"cmpl-{i:032x}", " word", np.array([1234], np.int32)) for i in range(n)]


def engine_side(deltas: list[StreamDelta], reps: int) -> tuple[float, bytes]:
    r, w = os.pipe()
    threading.Thread(target=lambda: [os.read(r, 1 << 20) for _ in iter(int, 1)], daemon=True).start()
    out = _Outbox(w)
    items = [(_Sink(i, out), d) for i, d in enumerate(deltas)]
    us = cpu_us(lambda: out.call_soon_threadsafe(driver._deliver, items), reps)
    return us, pickle.dumps(("deltas", [(i, d.text, d.token_ids.tobytes()) for i, d in enumerate(deltas)]),
                            protocol=pickle.HIGHEST_PROTOCOL)


async def server_side(frame: bytes, n: int, reps: int) -> float:
    pl = ProcessLoop.__new__(ProcessLoop)           # the reading half alone: no engine process
    pl._aloop, pl._keys_of = asyncio.get_running_loop(), {}
    queues = [asyncio.Queue() for _ in range(n)]
    pl._live = {i: _Remote(f"cmpl-{i:032x}", pl._aloop, q, {0}) for i, q in enumerate(queues)}
    data = _HEADER.pack(len(frame)) + frame

    def step():
        batches: dict = {}
        for f in _frames(bytearray(data)):
            pl._handle(pickle.loads(f), batches)
        pl._deliver(batches)
        for q in queues:
            q.get_nowait()
    return cpu_us(step, reps)


async def in_process(deltas: list[StreamDelta], reps: int) -> float:
    aloop = asyncio.get_running_loop()
    loop = driver.EngineLoop(None)
    queues = [asyncio.Queue() for _ in deltas]
    t0 = time.thread_time()
    for _ in range(reps):
        for d, q in zip(deltas, queues):
            loop._live[d.request_id] = driver._Live(aloop, q, 0.0, {0}, last_token=0.0)
        loop._dispatch(deltas)
        await asyncio.sleep(0)                       # the deliveries run
        for q in queues:
            q.get_nowait()
    return (time.thread_time() - t0) / reps * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--reps", type=int, default=3000)
    args = p.parse_args(argv)
    deltas = step_deltas(args.streams)
    child, frame = engine_side(deltas, args.reps)
    print(f"engine process: a step of {args.streams} deltas into one message: {child:.1f} us "
          f"({len(frame)} bytes; pickle.dumps alone {cpu_us(lambda: pickle.dumps(pickle.loads(frame), 5), args.reps):.1f} us)")
    server = asyncio.run(server_side(frame, args.streams, args.reps))
    print(f"server process: that message read, unpickled and queued: {server:.1f} us "
          f"({server / args.streams:.2f} us a delta; pickle.loads alone {cpu_us(lambda: pickle.loads(frame), args.reps):.1f} us)")
    here = asyncio.run(in_process(deltas, args.reps))
    print(f"one process: EngineLoop._dispatch of the same step and its deliveries: {here:.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
