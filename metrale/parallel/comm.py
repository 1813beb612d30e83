"""The Communicator protocol (one collective: all_to_all_v of rows), collectives built on it
(broadcast, gather, all_gather, all_reduce), and two fakes for CPU runs: FakeCommunicator (ranks as threads of one
process) and QueueCommunicator (ranks as processes, e.g. those of metrale.parallel.launch).

all_to_all_v(send, send_counts, recv_counts=None) -> (recv, recv_counts): send holds rows
[N, ...] grouped by destination rank in rank order, send_counts[r] rows for rank r; recv holds
the rows sent to this rank grouped by source rank in rank order. Every rank calls it the same
number of times in the same order (a collective), with one dtype and one row shape. recv_counts,
when the caller knows them (the reverse of an earlier exchange), saves the count exchange.
"""
from __future__ import annotations

import multiprocessing.queues
import queue
import threading
from typing import Callable, Protocol, Sequence

import numpy as np


class Communicator(Protocol):
    rank: int
    world_size: int

    def all_to_all_v(self, send: np.ndarray, send_counts: Sequence[int],
                     recv_counts: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]: ...

    def finish(self) -> None:
        """This rank sends nothing more: return once what it sent has left the process (a rank
        that exits next must not drop its last collective's pieces)."""


def _offsets(counts: np.ndarray) -> np.ndarray:
    off = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=off[1:])
    return off


def broadcast(comm: Communicator, data: np.ndarray | None, root: int = 0, dtype=np.int32) -> np.ndarray:
    """root's 1-D array on every rank (others pass None; `dtype` must be root's)."""
    world = comm.world_size
    if comm.rank == root:
        data = np.ascontiguousarray(data, dtype=dtype).reshape(-1)
        send, counts = np.tile(data, world), np.full(world, data.size, np.int64)
    else:
        send, counts = np.zeros(0, dtype), np.zeros(world, np.int64)
    recv, _ = comm.all_to_all_v(send, counts)
    return recv


def gather(comm: Communicator, rows: np.ndarray, root: int = 0) -> list[np.ndarray] | None:
    """Every rank's rows at root (a list by rank); None elsewhere."""
    counts = np.zeros(comm.world_size, np.int64)
    counts[root] = rows.shape[0]
    recv, got = comm.all_to_all_v(rows, counts)
    if comm.rank != root:
        return None
    off = _offsets(got)
    return [recv[off[r]:off[r + 1]] for r in range(comm.world_size)]


def all_gather(comm: Communicator, rows: np.ndarray) -> list[np.ndarray]:
    """Every rank's rows on every rank (a list by rank; counts may differ, row shapes may not)."""
    world = comm.world_size
    rows = np.ascontiguousarray(rows)
    recv, got = comm.all_to_all_v(np.concatenate([rows] * world) if world > 1 else rows,
                                  np.full(world, rows.shape[0], np.int64))
    off = _offsets(got)
    return [recv[off[r]:off[r + 1]] for r in range(world)]


def all_reduce(comm: Communicator, x: np.ndarray) -> np.ndarray:
    """The elementwise sum of every rank's x (same shape and dtype on all), summed in rank order,
    so every rank gets the same bits (tensor parallelism's partial sums; metrale/parallel/tp.py).
    Built on all_to_all_v (each rank receives all N arrays): right for the CPU fakes; NCCL has its
    own ncclAllReduce (docs/parallel.md)."""
    x = np.asarray(x)
    pieces = all_gather(comm, x.reshape(1, -1))
    out = pieces[0].copy()
    for p in pieces[1:]:
        out += p
    return out.reshape(x.shape)


class FakeWorld:
    """Mailboxes and a barrier shared by `size` FakeCommunicators (one per thread)."""

    def __init__(self, size: int, timeout: float = 60.0):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.box: list[list[np.ndarray | None]] = [[None] * size for _ in range(size)]

    def communicators(self) -> list["FakeCommunicator"]:
        return [FakeCommunicator(self, r) for r in range(self.size)]


def _split(comm, send, send_counts) -> list[np.ndarray]:
    """send's rows cut by destination rank (checked against send_counts)."""
    send = np.asarray(send)
    counts = np.asarray(send_counts, np.int64)
    if counts.shape != (comm.world_size,) or counts.sum() != send.shape[0] or (counts < 0).any():
        raise ValueError(f"rank {comm.rank}: send_counts {counts.tolist()} do not split {send.shape[0]} rows over {comm.world_size} ranks")
    off = _offsets(counts)
    return [send[off[d]:off[d + 1]] for d in range(comm.world_size)]


def _join(comm, pieces: list[np.ndarray], send: np.ndarray, recv_counts) -> tuple[np.ndarray, np.ndarray]:
    """The received pieces (by source rank) as (rows, counts), after the protocol's checks."""
    send = np.asarray(send)
    for src, p in enumerate(pieces):
        if p.dtype != send.dtype or p.shape[1:] != send.shape[1:]:
            raise ValueError(f"rank {comm.rank}: rows {send.dtype}{send.shape[1:]} but rank {src} sent {p.dtype}{p.shape[1:]}")
    got = np.array([p.shape[0] for p in pieces], np.int64)
    if recv_counts is not None and not np.array_equal(got, np.asarray(recv_counts, np.int64)):
        raise ValueError(f"rank {comm.rank}: expected {list(recv_counts)} rows, got {got.tolist()}")
    return np.concatenate(pieces), got


class FakeCommunicator:
    def __init__(self, world: FakeWorld, rank: int):
        self.world, self.rank, self.world_size = world, rank, world.size
        self.calls = 0

    def _wait(self) -> None:
        try:
            self.world.barrier.wait()
        except threading.BrokenBarrierError:
            raise RuntimeError(f"rank {self.rank}: another rank failed or never reached collective #{self.calls}") from None

    def all_to_all_v(self, send, send_counts, recv_counts=None):
        for dst, piece in enumerate(_split(self, send, send_counts)):
            self.world.box[self.rank][dst] = piece.copy()
        self._wait()
        pieces = [self.world.box[src][self.rank] for src in range(self.world_size)]
        self._wait()     # all have read before anyone's next call overwrites the boxes
        self.calls += 1
        return _join(self, pieces, send, recv_counts)

    def finish(self) -> None:
        pass                     # the boxes are shared memory: nothing in flight


class QueueCommunicator:
    """Ranks as processes: boxes[r] (a multiprocessing Queue made by the parent, one per rank) is
    rank r's inbox. A collective puts each peer's piece, tagged (collective number, source), in
    the peer's inbox and takes its own pieces, keeping early pieces of later collectives. A rank
    that waits more than `timeout` seconds for a piece raises (a peer failed or is hung)."""

    def __init__(self, rank: int, boxes: Sequence, timeout: float = 120.0):
        self.rank, self.world_size = rank, len(boxes)
        self.boxes, self.timeout = boxes, timeout
        self.calls = 0
        self._early: dict[tuple[int, int], np.ndarray] = {}

    def all_to_all_v(self, send, send_counts, recv_counts=None):
        pieces: list[np.ndarray | None] = [None] * self.world_size
        for dst, piece in enumerate(_split(self, send, send_counts)):
            if dst == self.rank:
                pieces[dst] = piece.copy()
            else:
                # a copy: the queue's feeder thread pickles it later, after the caller may have
                # overwritten its buffer for the next step
                self.boxes[dst].put((self.calls, self.rank, np.array(piece, copy=True, order="C")))
        for src in range(self.world_size):
            while pieces[src] is None:
                if (self.calls, src) in self._early:
                    pieces[src] = self._early.pop((self.calls, src))
                    break
                try:
                    call, s, p = self.boxes[self.rank].get(timeout=self.timeout)
                except queue.Empty:
                    raise RuntimeError(f"rank {self.rank}: no rows from rank {src} within {self.timeout:.0f} s "
                                       f"(collective #{self.calls}): it failed or is hung") from None
                self._early[(call, s)] = p
        self.calls += 1
        return _join(self, pieces, send, recv_counts)

    def wait_for(self, src: int, alive: Callable[[], bool] = lambda: True, poll: float = 1.0) -> None:
        """Block until rank src's piece of this rank's next collective has arrived, for as long as
        that takes while alive() holds (a follower between steps: the leader's Engine may have no
        request for any length of time; inside a step the per-piece timeout still applies)."""
        while (self.calls, src) not in self._early:
            try:
                call, s, p = self.boxes[self.rank].get(timeout=poll)
            except queue.Empty:
                if not alive():
                    raise RuntimeError(f"rank {self.rank}: rank {src} is gone (waiting for collective "
                                       f"#{self.calls})") from None
                continue
            self._early[(call, s)] = p

    def finish(self) -> None:
        # a queue's feeder thread writes the pieces later; os._exit (metrale.parallel.launch) would kill it
        for dst, box in enumerate(self.boxes):
            if dst != self.rank and isinstance(box, multiprocessing.queues.Queue):
                box.close()
                box.join_thread()


def run_ranks(size: int, fn: Callable[[FakeCommunicator], object], timeout: float = 60.0) -> list:
    """fn(comm) on `size` threads, one FakeCommunicator each; their results by rank. The first
    failure breaks the barrier (the others stop at their next collective) and is re-raised."""
    world = FakeWorld(size, timeout)
    results: list = [None] * size
    errors: list[BaseException | None] = [None] * size

    def body(comm: FakeCommunicator) -> None:
        try:
            results[comm.rank] = fn(comm)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[comm.rank] = e
            world.barrier.abort()

    threads = [threading.Thread(target=body, args=(c,), name=f"rank{c.rank}") for c in world.communicators()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not (isinstance(e, RuntimeError) and "another rank failed" in str(e))), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results
