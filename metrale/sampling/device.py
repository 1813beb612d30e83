"""DevicePipeline: the sampling kernels on the CUDA backend's stream, over its device logits.

Buffers are allocated once (rows = the backend's max_rows; the sparse list grows when a step needs
more) and reused: one pinned host staging buffer and one device buffer for the inputs (int32 words:
iparams | fparams | adj_token | adj_rep | adj_add | mask rows), copied with one transfer of the
prefix a step uses, and one output buffer (tokens | logprobs | top ids | top logprobs) fetched
with one transfer. The kernels themselves allocate nothing.

A step's layout depends only on (rows, list length, mask words, logits buffer, whether top-p rows
are split, whether a row has a pending token): the device views of that layout are built once, and
with `graphs` the kernels of a layout without adjustments are captured once as a CUDA graph and
replayed (two Numba launches and their argument marshalling cost more host time than a small
model's decode step leaves; a layout with adjustments or pending tokens runs eagerly, since a
capture's warm-up would apply them to the logits twice).

Pending tokens (the loop a step ahead, metrale/overlap.py): a penalized row packed before the
previous step's token was read names that step's row (iparams I_PENDING); prepare_rows reads the
token from this pipeline's own output (the previous launch's tokens, which the next sample_rows
overwrites only after prepare_rows has read them) and counts it (kernels_numba/sampling.py).
"""
from __future__ import annotations

import logging

import numpy as np
from numba import cuda

from kernels_numba import sampling as K
from metrale.runtime.cuda import Event, cu
from metrale.runtime.cuda.graph import CudaGraph

log = logging.getLogger("metrale.sampling")

TOP = K.MAX_TOP_LOGPROBS
MAX_ADJ_LAYOUTS = 64    # layouts with adjustments kept (their list length changes nearly every step)
ADJ_SLOTS = 256         # a layout's list spans hold a multiple of this (a penalized row's list grows each step)


def _ptr(array) -> int:
    return array.__cuda_array_interface__["data"][0]


def list_slots(n: int) -> int:
    """The entries a layout's list spans hold for a step of n (the rows read only their slices, so
    the slots past n are never read: a growing list keeps its layout for ADJ_SLOTS entries)."""
    return -(-n // ADJ_SLOTS) * ADJ_SLOTS


def device_logits(backend, batch):
    """Run the forward and return the device logits [R, V] (no copy to the host)."""
    return backend.forward_device(batch)


class PendingDraw:
    """A launched sampling step: `result()` waits for its event and returns (tokens, logprobs,
    top ids, top logprobs) of its rows."""

    def __init__(self, host: np.ndarray, event, rows: int) -> None:
        self.host, self.event, self.rows = host, event, rows

    def result(self):
        self.event.synchronize()
        R, out = self.rows, self.host[:self.rows * (2 + 2 * TOP)].copy()
        return (out[0:R], out[R:2 * R].view(np.float32), out[2 * R:2 * R + R * TOP].reshape(R, TOP),
                out[2 * R + R * TOP:].view(np.float32).reshape(R, TOP))


class _Layout:
    """One step layout's spans of the input buffer and the kernels' device views over it."""

    def __init__(self, pipe: "DevicePipeline", logits, R: int, N: int, W: int, top_p: bool) -> None:
        self.top_p = top_p              # top-p rows without top-k drawn from spans too
        self.spans, off = {}, 0
        for name, size in (("i", R * K.NI), ("f", R * K.NF), ("tok", N), ("rep", N), ("add", N), ("mask", R * W)):
            self.spans[name] = (off, off + size)
            off += size
        self.words = off
        d = pipe.in_dev

        def view(name, shape=None, dtype=np.int32):
            a, b = self.spans[name]
            v = d[a:max(b, a + 1)]
            if dtype is not np.int32:
                v = v.view(dtype)
            return v.reshape(shape) if shape is not None else v

        iparams, fparams = view("i", (R, K.NI)), view("f", (R, K.NF), np.float32)
        tok, rep, add = view("tok"), view("rep"), view("add", None, np.float32)
        mask_d = view("mask", (R, W), np.uint32)
        o = pipe.out_dev
        tokens, lps = o[0:R], o[R:2 * R].view(np.float32)
        top_ids = o[2 * R:2 * R + R * TOP].reshape(R, TOP)
        top_lps = o[2 * R + R * TOP:2 * R + 2 * R * TOP].view(np.float32).reshape(R, TOP)
        self.prepare_args = (logits, fparams, iparams, tok, rep, add, pipe.raw_saved, pipe.lse, top_ids, top_lps)
        self.sample_args = (logits, mask_d, fparams, iparams, tok, pipe.raw_saved, pipe.lse, tokens, lps)
        self.graph: CudaGraph | None = None


def _pack_inputs(h: np.ndarray, spans: dict, rows, mask: np.ndarray) -> None:
    """The step's inputs into the staging buffer h at the layout's spans (the lists: their prefix)."""
    for name, values in (("i", rows.iparams.ravel()), ("f", rows.fparams.ravel().view(np.int32)),
                         ("tok", rows.adj_token), ("rep", rows.adj_rep), ("add", rows.adj_add.view(np.int32)),
                         ("mask", np.ascontiguousarray(mask, np.uint32).ravel().view(np.int32))):
        a = spans[name][0]
        h[a:a + values.size] = values


class DevicePipeline:
    def __init__(self, backend, vocab_size: int, graphs: bool = True, split: bool = True):
        self.stream = backend.stream
        self.graphs = graphs
        self._layouts: dict[tuple, _Layout] = {}
        self._adj_layouts = 0           # how many of them run eagerly (adjustments or pending tokens)
        self.words = -(-vocab_size // 32)
        self.max_rows = int(backend.max_rows)
        self.capacity = 0
        self._turn = 0                  # which of the two staging / result buffers the next step uses
        self._alloc(4096)
        R = self.max_rows
        self.out_dev = cuda.device_array(R * (2 + 2 * TOP), np.int32)
        self.out_hosts = [cuda.pinned_array(R * (2 + 2 * TOP), np.int32) for _ in range(2)]
        self.events = [Event(timing=False) for _ in range(2)]
        self.lse = cuda.device_array(R, np.float32)
        self.parts = K.split_parts(R) if split else None       # the split rows' span partials
        self.pending = K.pending_buffers(self.out_dev[:R], R)  # pending tokens: the last launch's
        self._last: PendingDraw | None = None

    def _alloc(self, capacity: int) -> None:
        """Two pinned staging buffers: a step queued ahead packs into one while the other's copy
        may still be waiting on the stream."""
        R = self.max_rows
        self.stream.synchronize()       # no queued copy still reads the old buffers
        self.capacity = capacity
        n = R * (K.NI + K.NF + self.words) + 3 * capacity
        self.in_hosts = [cuda.pinned_array(n, np.int32) for _ in range(2)]
        self.in_dev = cuda.device_array(n, np.int32)
        self.raw_saved = cuda.device_array(max(capacity, 1), np.float32)
        self._layouts = {}                  # their views were of the old buffers
        self._adj_layouts = 0

    def forward(self, backend, batch):
        return device_logits(backend, batch)

    def run(self, logits, mask: np.ndarray, rows):
        return self.launch(logits, mask, rows).result()

    def launch(self, logits, mask: np.ndarray, rows, feed=None, after: PendingDraw | None = None) -> PendingDraw:
        """Queues the pipeline over `logits` on the backend's stream; feed: a device int32 array the
        drawn tokens are copied into as well (the next step's embedding reads them there); after:
        the step whose tokens rows with a pending token name (it must be the last one launched)."""
        R, N = rows.fparams.shape[0], list_slots(rows.adj_token.size)
        if R > self.max_rows:
            raise ValueError(f"{R} sampling rows exceed the device sampler's {self.max_rows}")
        if rows.pending and (after is None or after is not self._last):
            raise RuntimeError("pending tokens are read from the step launched just before")
        if N > self.capacity:
            self._alloc(max(N, 2 * self.capacity))
        turn = self._turn
        self._turn ^= 1
        W = mask.shape[1]
        top_p = self.parts is not None and K.top_p_split_rows(rows.fparams, rows.iparams, logits.shape[1])
        eager = bool(N or rows.pending)      # never captured: its adjustments change the logits
        key = (R, N, W, _ptr(logits), logits.shape[0], top_p, rows.pending)
        lay = self._layouts.get(key)
        if lay is None:
            if eager and self._adj_layouts >= MAX_ADJ_LAYOUTS:
                # penalty / bias lists change length nearly every step: without a bound the cache
                # would keep a layout per (rows, length) seen, for the process's life
                self._layouts = {k: v for k, v in self._layouts.items() if k[1] == 0 and not k[-1]}
                self._adj_layouts = 0
            lay = self._layouts[key] = _Layout(self, logits, R, N, W, top_p)
            self._adj_layouts += eager
        h = self.in_hosts[turn]
        _pack_inputs(h, lay.spans, rows, mask)
        s = self.stream
        cu("cuMemcpyHtoDAsync", _ptr(self.in_dev), h.ctypes.data, lay.words * 4, s.handle)
        if self.graphs and not eager and lay.graph is None:
            lay.graph = self._capture(lay)
        if lay.graph is not None:
            lay.graph.replay()
        else:
            self._kernels(lay)
        o = self.out_dev
        if feed is not None:
            cu("cuMemcpyDtoDAsync", _ptr(feed), _ptr(o), R * 4, s.handle)
        n_out = R * (2 + 2 * TOP)
        host = self.out_hosts[turn]
        cu("cuMemcpyDtoHAsync", host.ctypes.data, _ptr(o), n_out * 4, s.handle)
        self.events[turn].record(s)
        self._last = PendingDraw(host, self.events[turn], R)
        return self._last

    def _capture(self, lay: _Layout) -> CudaGraph | None:
        """The layout's two kernels as a graph; None (and eager from now on) if the capture fails,
        so no step is lost to it."""
        try:
            return CudaGraph.capture(self.stream, lambda: self._kernels(lay), warmup=1)
        except Exception as exc:
            log.warning("sampling kernels not captured as a CUDA graph (%s: %s); launching them eagerly",
                        type(exc).__name__, exc)
            self.graphs = False
            return None

    def _kernels(self, lay: _Layout) -> None:
        st = self.stream.numba
        K.prepare_rows(*lay.prepare_args, pending=self.pending, stream=st)
        K.sample_rows(*lay.sample_args, parts=self.parts, top_p=lay.top_p, pending=self.pending, stream=st)
