"""Collectives on device buffers for tensor parallelism on the CUDA backend (docs/parallel.md,
"The CUDA side"): what a rank's kernels need between them, queued on the backend's stream.

  all_reduce(buf, stream)          buf (float32 device array) <- the sum of every rank's buf, in place
  all_gather(send, recv, stream)   recv[r * send.size:(r + 1) * send.size] <- rank r's send, on every rank

Two implementations:
  NcclCollectives    ncclAllReduce / ncclAllGather through nccl4py 0.6.0 on the stream, no host
                     sync, graph-capturable (one GPU a process).
  StagedCollectives  device -> host, the host Communicator's all_reduce / all_gather (comm.py:
                     FakeCommunicator threads, QueueCommunicator processes), host -> device; it
                     waits for the stream, so it cannot be captured (tests, the simulator).
Every rank gets the same bits (NCCL reduces each element once and copies the result out; the
staged sum adds in rank order on every rank), so the replicated residual stays replicated.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from metrale.parallel.comm import Communicator, all_gather, all_reduce


class DeviceCollectives(Protocol):
    rank: int
    world_size: int
    graph_safe: bool          # its calls may be recorded into a CUDA graph
    calls: dict[str, int]     # collectives issued, by name (tests count them)

    def all_reduce(self, buf, stream) -> None: ...

    def all_gather(self, send, recv, stream) -> None: ...

    def close(self) -> None: ...


def _sync(stream) -> None:
    """Wait for the work queued on stream (a metrale Stream or anything with synchronize)."""
    if stream is not None and hasattr(stream, "synchronize"):
        stream.synchronize()


class StagedCollectives:
    """Device collectives through a host Communicator: each call copies its buffers out, runs the
    host collective and copies the result back (synchronous: not for graphs)."""
    graph_safe = False

    def __init__(self, comm: Communicator):
        self.comm, self.rank, self.world_size = comm, comm.rank, comm.world_size
        self.calls = {"all_reduce": 0, "all_gather": 0}

    def all_reduce(self, buf, stream) -> None:
        self.calls["all_reduce"] += 1
        _sync(stream)
        buf.copy_to_device(all_reduce(self.comm, buf.copy_to_host()))

    def all_gather(self, send, recv, stream) -> None:
        self.calls["all_gather"] += 1
        _sync(stream)
        parts = all_gather(self.comm, send.copy_to_host().reshape(1, -1))
        n = send.size * self.world_size
        recv.reshape(recv.size)[:n].copy_to_device(np.concatenate(parts).reshape(-1))

    def close(self) -> None:
        pass


def _pointer(buf) -> tuple[int, int, np.dtype]:
    """(device address, element count, dtype) of a contiguous device array."""
    ai = buf.__cuda_array_interface__
    return int(ai["data"][0]), int(np.prod(ai["shape"], dtype=np.int64)), np.dtype(ai["typestr"])


class NcclCollectives:
    """ncclAllReduce (sum, in place) and ncclAllGather on device arrays through nccl4py 0.6.0:
    nccl.bindings.nccl.all_reduce(send, recv, count, dtype, op, comm, stream) and
    all_gather(send, recv, count, dtype, comm, stream) on raw pointers (the public
    Communicator.allreduce / allgather resolve their buffers through cuda.core on every call:
    Python work an eager step's 2 L + 1 calls do not need). Queued on the given stream, no
    host sync: inside the backend's _run, so the decode graphs capture them."""
    graph_safe = True

    def __init__(self, comm):
        from metrale.parallel.nccl import _import_nccl, _stream_handle
        nccl = _import_nccl()
        from nccl.bindings import nccl as raw
        self._raw, self._stream_handle = raw, _stream_handle
        self._comm = comm                                  # nccl.core.Communicator
        self._sum = int(nccl.NcclRedOp.SUM)
        self._types = {np.dtype(np.float32): int(nccl.NcclDataType.FLOAT)}
        self.rank, self.world_size = int(comm.rank), int(comm.nranks)
        self.calls = {"all_reduce": 0, "all_gather": 0}

    @classmethod
    def create(cls, rank: int, world_size: int, unique_id: bytes) -> "NcclCollectives":
        """Join the NCCL clique (collective over all ranks; this process's GPU current)."""
        from metrale.parallel.nccl import _import_nccl
        nccl = _import_nccl()
        return cls(nccl.Communicator.init(nranks=world_size, rank=rank, unique_id=nccl.UniqueId.from_bytes(unique_id)))

    def _dtype(self, dtype: np.dtype) -> int:
        if dtype not in self._types:
            raise TypeError(f"NcclCollectives: {dtype} buffers are not wired (float32 only)")
        return self._types[dtype]

    def all_reduce(self, buf, stream) -> None:
        ptr, n, dtype = _pointer(buf)
        kind = self._dtype(dtype)
        self.calls["all_reduce"] += 1
        self._raw.all_reduce(ptr, ptr, n, kind, self._sum, self._comm._comm, self._stream_handle(stream))

    def all_gather(self, send, recv, stream) -> None:
        sp, n, dtype = _pointer(send)
        rp, m, _ = _pointer(recv)
        if m < n * self.world_size:
            raise ValueError(f"all_gather: recv holds {m} elements, {self.world_size} ranks x {n} needed")
        kind = self._dtype(dtype)
        self.calls["all_gather"] += 1
        self._raw.all_gather(sp, rp, n, kind, self._comm._comm, self._stream_handle(stream))

    def close(self) -> None:
        """Tear the communicator down without waiting for the peers (they may have exited)."""
        self._comm.abort()
