"""Nccl4pyCommunicator: the Communicator protocol over NCCL through nccl4py 0.6.0 (`nccl.core`),
imported lazily (only a multi-GPU run needs it; nothing here runs on a machine without one).

nccl4py's public API as used here (checked against the 0.6.0 wheel, nccl/core/*.py):
  nccl.get_unique_id() -> UniqueId; UniqueId.as_bytes (128 bytes); UniqueId.from_bytes(b)
    (utils.py). The id opens a bootstrap socket in the process that made it (rank 0 here), which
    must live until every rank has joined.
  nccl.Communicator.init(nranks, rank, unique_id) (communicator.py: ncclCommInitRankScalable),
    on the device current in the calling thread; comm.rank, comm.nranks; comm.destroy() (a
    collective of the node's ranks) and comm.abort() (error path).
  comm.send(buf, peer, *, stream=None), comm.recv(buf, peer, *, stream=None): buf is any object
    with the CUDA array interface (Numba device arrays; cuda.core's StridedMemoryView reads it
    with no stream sync), its dtype mapped to NCCL's (uint8 here); stream an int cudaStream_t, a
    cuda.core Stream or an object with __cuda_stream__ (None = the legacy default stream).
  `with nccl.group():` = ncclGroupStart/End (group.py).
nccl4py finds libnccl.so.2 through cuda.pathfinder (the site-packages of the interpreter, not
PYTHONPATH; then dlopen's search, which honours LD_LIBRARY_PATH; then $NCCL_HOME/lib).

all_to_all_v = one grouped exchange of the int64 counts (skipped when the caller passes
recv_counts) + one grouped send/recv per peer of the row bytes, on one stream, then a stream
synchronize (the host needs the counts; rows stay on the device). Host NumPy inputs are staged
to the device on that stream and the result copied back (for the plan and token ids, which are
small). device=False keeps every buffer on the host: only for tests with a fake `nccl.core`.
"""
from __future__ import annotations

import numpy as np


def _import_nccl():
    try:
        import nccl.core as nccl
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError("expert parallelism over NCCL needs nccl4py: pip install nccl4py "
                          "(with a CUDA 12/13 NCCL runtime)") from e
    return nccl


def nccl_unique_id() -> bytes:
    """A new NCCL unique id as bytes: made on rank 0, handed to the others out of band."""
    return bytes(_import_nccl().get_unique_id().as_bytes)


def nccl_info() -> dict:
    """nccl4py's version and the libnccl it loaded (path, version): for diagnostics."""
    nccl = _import_nccl()
    v = nccl.get_version()
    lib = v.libnccl
    return {"nccl4py": str(v.nccl4py), "bindings": str(v.nccl_bindings),
            "libnccl": None if lib is None else str(lib.version),
            "libnccl_path": None if lib is None or lib.path is None else str(lib.path)}


def _stream_handle(stream) -> int:
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    if hasattr(stream, "ptr"):          # metrale.runtime.cuda.Stream
        return int(stream.ptr)
    h = getattr(stream, "handle", stream)
    h = getattr(h, "value", h)          # ctypes c_void_p
    return int(h or 0)


class Nccl4pyCommunicator:
    def __init__(self, comm, *, stream=None, device: bool = True):
        self._nccl = _import_nccl()
        self._comm = comm
        self.rank, self.world_size = int(comm.rank), int(comm.nranks)
        self._device = device
        self.device_buffers = device    # all_to_all_v takes and returns device arrays
        self.set_stream(stream)

    @classmethod
    def create(cls, rank: int, world_size: int, unique_id: bytes, **kw) -> "Nccl4pyCommunicator":
        """Join the NCCL clique (collective over all ranks; each rank's GPU already current,
        e.g. numba.cuda.select_device)."""
        nccl = _import_nccl()
        comm = nccl.Communicator.init(nranks=world_size, rank=rank, unique_id=nccl.UniqueId.from_bytes(unique_id))
        return cls(comm, **kw)

    @staticmethod
    def new_unique_id() -> bytes:
        return nccl_unique_id()

    def set_stream(self, stream) -> None:
        """The stream the exchanges run on (the backend's: ordered after its kernels)."""
        self._stream = stream
        self._numba_stream = None

    def close(self) -> None:
        """Destroy the communicator: every rank of the node must call it (it waits for them)."""
        self._comm.destroy()

    def finish(self) -> None:
        pass                     # each exchange is enqueued on the stream before it returns

    def abort(self) -> None:
        """Tear the communicator down without waiting for the peers (after a failure)."""
        self._comm.abort()

    # -------------------------------------------------------------------- buffers
    def _on_device(self, a) -> bool:
        return hasattr(a, "__cuda_array_interface__")

    def _staging_stream(self):
        """self._stream as a Numba stream, so host -> device staging is ordered before the NCCL
        work queued on it (a legacy-stream copy is not ordered with a non-blocking stream)."""
        if self._numba_stream is None:
            if self._stream is None:
                self._numba_stream = 0
            elif hasattr(self._stream, "numba"):
                self._numba_stream = self._stream.numba
            else:
                from numba import cuda
                self._numba_stream = cuda.external_stream(_stream_handle(self._stream))
        return self._numba_stream

    def _to_buffer(self, a):
        if not self._device or self._on_device(a):
            return a
        from numba import cuda
        return cuda.to_device(np.ascontiguousarray(a), stream=self._staging_stream())

    def _empty(self, shape, dtype):
        if not self._device:
            return np.empty(shape, dtype)
        from numba import cuda
        return cuda.device_array(shape, dtype)

    @staticmethod
    def _bytes(a):
        return a.reshape(a.size).view(np.uint8)

    def _sync(self) -> None:
        if not self._device:
            return
        if self._stream is not None and hasattr(self._stream, "synchronize"):
            self._stream.synchronize()
        else:
            from numba import cuda
            cuda.synchronize()

    def _exchange(self, send_bytes, send_off, recv_bytes, recv_off) -> None:
        s = _stream_handle(self._stream)
        with self._nccl.group():
            for p in range(self.world_size):
                if send_off[p + 1] > send_off[p]:
                    self._comm.send(send_bytes[send_off[p]:send_off[p + 1]], p, stream=s)
                if recv_off[p + 1] > recv_off[p]:
                    self._comm.recv(recv_bytes[recv_off[p]:recv_off[p + 1]], p, stream=s)

    # -------------------------------------------------------------------- the collective
    def all_to_all_v(self, send, send_counts, recv_counts=None):
        world = self.world_size
        counts = np.asarray(send_counts, np.int64)
        if counts.shape != (world,) or counts.sum() != send.shape[0]:
            raise ValueError(f"rank {self.rank}: send_counts {counts.tolist()} do not split {send.shape[0]} rows")
        host_in = isinstance(send, np.ndarray) and self._device
        if recv_counts is None:
            cs = self._to_buffer(counts)
            cr = self._empty((world,), np.int64)
            step = np.arange(world + 1, dtype=np.int64) * 8
            self._exchange(self._bytes(cs), step, self._bytes(cr), step)
            self._sync()
            recv_counts = cr if isinstance(cr, np.ndarray) else cr.copy_to_host()
        recv_counts = np.asarray(recv_counts, np.int64)
        row_bytes = int(np.dtype(send.dtype).itemsize * int(np.prod(send.shape[1:], dtype=np.int64)))
        recv = self._empty((int(recv_counts.sum()),) + tuple(send.shape[1:]), send.dtype)
        so = np.concatenate([[0], np.cumsum(counts)]) * row_bytes
        ro = np.concatenate([[0], np.cumsum(recv_counts)]) * row_bytes
        if row_bytes and (so[-1] or ro[-1]):
            src = self._to_buffer(send) if so[-1] else None
            self._exchange(self._bytes(src) if so[-1] else None, so, self._bytes(recv) if ro[-1] else None, ro)
            self._sync()
        if host_in and not isinstance(recv, np.ndarray):
            recv = recv.copy_to_host()
        return recv, recv_counts
