"""Dequantization of block-quantized weights (the planes of quant_layout.repack) on the device:

  dequant_bf16(planes, out, qtype, n_off)   out[n_off + n, :] = bf16(w[n, :]) for every row n of the
                                            part (out uint16 [N_total, K]): the many-rows path of a
                                            quantized linear (a bf16 scratch the bf16 GEMMs read)
  gather_rows(planes, ids, out, qtype)      out[t, :] = w[ids[t], :] as float32 (out [T, K]); ids
                                            outside [0, N) give zero rows: a quantized token_embd
  feed_ids(ids, src, prev)                  ids[t] = prev[src[t]] where src[t] >= 0 (the host a step
                                            ahead: embedding.embedding_feed's ids, before gather_rows)

One thread a group of 32 values (its 16-byte qs load, its scales: the K-quant header decoded for
the group's index), 32 values written as four 16-byte stores (bf16) or eight (float32). Values
are d q + m in fp32 (as gguf's dequantization computes them) and rounded to bf16 to nearest even.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, uint32

from kernels_numba.ptx import grid_trigger, grid_wait, pack_bf16x2
from kernels_numba.quant_gemv import U16, MASK16, kq_scale_min, q4_ops, q5_ops, q6_ops, sbyte
from kernels_numba.quant_layout import KQUANTS, NAMES, Q4_0, Q4_1, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from kernels_numba.quant_ptx import h2f, ldg_b2, ldg_b4, ldg_b16, stg_f32x4, stg_u16x8

__all__ = ["dequant_bf16", "gather_rows", "feed_ids", "feed_ids_ref", "THREADS"]

THREADS = 128


def _make(QT: int, GATHER: bool):
    KQ = QT in KQUANTS
    Q6 = QT == Q6_K
    Q5 = QT in (Q5_0, Q5_1, Q5_K)
    HAS_MIN = QT in (Q4_1, Q5_1)
    OFF = float32({Q4_0: 8, Q5_0: 16}.get(QT, 0))

    def deq(qs, qh, sc, dm, ids, out, n_off):
        grid_wait()      # PDL: ids are written by earlier kernels; out may still be read by one
        grid_trigger()
        K = out.shape[1]
        G = K >> 5
        NSB = K >> 8
        N = qs.shape[0]
        M = ids.shape[0] if GATHER else N
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        m = i // G
        if m >= M:
            return
        p = i - m * G                       # the group's position in the planes
        row = ids[m] if GATHER else m
        valid = row >= 0 and row < N
        row = min(max(row, 0), N - 1)
        vals = cuda.local.array(32, float32)
        if KQ:
            j = p // NSB
            s = p - j * NSB
            g = 8 * s + j
        else:
            j = 0
            s = p
            g = p
        if QT == Q8_0:
            a = ldg_b16(qs, row, p << 4)
            b = ldg_b16(qs, row, (G + p) << 4)
            d = h2f(ldg_b2(dm, row, p << 1))
            for e in range(4):
                for h in range(2):
                    wv = a[e] if h == 0 else b[e]
                    for bb in range(4):
                        vals[16 * h + 4 * e + bb] = d * float32(sbyte(wv, bb))
        else:
            q = ldg_b16(qs, row, p << 4)
            if Q6:
                hw0 = ldg_b4(qh, row, (((j >> 1) * NSB + s) << 4) + ((j & 1) << 3))
                hw1 = ldg_b4(qh, row, (((j >> 1) * NSB + s) << 4) + ((j & 1) << 3) + 4)
                ops = q6_ops(q[0], q[1], q[2], q[3], hw0, hw1)
            elif Q5:
                if KQ:
                    hw = ldg_b4(qh, row, (((j >> 2) * NSB + s) << 4) + ((j & 3) << 2))
                else:
                    hw = ldg_b4(qh, row, p << 2)
                ops = q5_ops(q[0], q[1], q[2], q[3], hw)
            else:
                ops = q4_ops(q[0], q[1], q[2], q[3])
            if Q6:
                sw = ldg_b4(sc, row, (s << 4) + ((j >> 1) << 2))
                d = h2f(ldg_b2(dm, row, s << 1))
                da = d * float32(sbyte(sw, 2 * (j & 1)))
                db = d * float32(sbyte(sw, 2 * (j & 1) + 1))
                for w in range(8):
                    for bb in range(4):
                        c = float32(int32((ops[w] >> uint32(8 * bb)) & uint32(255)) - 32)
                        vals[4 * w + bb] = (da if w < 4 else db) * c
            elif KQ:
                hd = ldg_b16(sc, row, s << 4)
                scj, mnj = kq_scale_min(hd[1], hd[2], hd[3], j)
                dl = h2f(hd[0] & MASK16) * float32(scj)
                ml = h2f(hd[0] >> U16) * float32(mnj)
                for w in range(8):
                    for bb in range(4):
                        vals[4 * w + bb] = dl * float32((ops[w] >> uint32(8 * bb)) & uint32(255)) - ml
            else:
                if HAS_MIN:
                    dmw = ldg_b4(dm, row, p << 2)
                    d = h2f(dmw & MASK16)
                    mm = h2f(dmw >> U16)
                else:
                    d = h2f(ldg_b2(dm, row, p << 1))
                    mm = float32(0.0)
                for w in range(8):
                    for bb in range(4):
                        c = float32((ops[w] >> uint32(8 * bb)) & uint32(255))
                        if HAS_MIN:
                            vals[4 * w + bb] = d * c + mm
                        else:
                            vals[4 * w + bb] = d * (c - OFF)
        if GATHER:
            for e in range(8):
                o = 4 * e
                if valid:
                    stg_f32x4(out, m, 32 * g + o, vals[o], vals[o + 1], vals[o + 2], vals[o + 3])
                else:
                    z = float32(0.0)
                    stg_f32x4(out, m, 32 * g + o, z, z, z, z)
        else:
            for e in range(4):
                o = 8 * e
                stg_u16x8(out, n_off + m, 32 * g + o, pack_bf16x2(vals[o], vals[o + 1]),
                          pack_bf16x2(vals[o + 2], vals[o + 3]), pack_bf16x2(vals[o + 4], vals[o + 5]),
                          pack_bf16x2(vals[o + 6], vals[o + 7]))

    return deq


_PY: dict = {}
_KERNELS: dict = {}


def py_kernel(qtype: int, gather: bool):
    key = (qtype, gather)
    if key not in _PY:
        _PY[key] = _make(qtype, gather)
    return _PY[key]


def kernel(qtype: int, gather: bool):
    key = (qtype, gather)
    if key not in _KERNELS:
        _KERNELS[key] = cuda.jit(py_kernel(qtype, gather))
    return _KERNELS[key]


def _check(planes: dict, qtype: int, K: int) -> int:
    if qtype not in NAMES:
        raise ValueError(f"ggml type {qtype} has no device dequantization")
    assert K % (256 if qtype in KQUANTS else 32) == 0, f"{NAMES[qtype]}: K={K}"
    return planes["qs"].shape[0]


def dequant_bf16(planes: dict, out, qtype: int, n_off: int = 0, stream=0) -> None:
    """out[n_off:n_off+N] (uint16 bf16 bits [N_total, K]) = the part's rows, dequantized."""
    K = out.shape[1]
    N = _check(planes, qtype, K)
    assert out.dtype == np.uint16 and n_off + N <= out.shape[0]
    total = N * (K // 32)
    kernel(qtype, False)[-(-total // THREADS), THREADS, stream](
        planes["qs"], planes["qh"], planes["sc"], planes["dm"], ids_filler(), out, n_off)


_FILLER: list = []


def ids_filler():
    """The int32 device array passed for dequant_bf16's unused ids argument, made at the first call
    (call it once before a graph capture)."""
    if not _FILLER:
        _FILLER.append(cuda.to_device(np.zeros(1, np.int32)))
    return _FILLER[0]


def gather_rows(planes: dict, ids, out, qtype: int, stream=0) -> None:
    """out[t, :] = float32 w[ids[t], :] (zeros where ids[t] is outside [0, N)); ids int32 [T],
    out float32 [T, K]."""
    K = out.shape[1]
    _check(planes, qtype, K)
    T = ids.shape[0]
    assert out.dtype == np.float32 and out.shape[0] >= T
    if T == 0:
        return
    total = T * (K // 32)
    kernel(qtype, True)[-(-total // THREADS), THREADS, stream](
        planes["qs"], planes["qh"], planes["sc"], planes["dm"], ids, out, 0)


def _feed_ids_kernel(ids, src, prev):
    grid_wait()      # PDL: prev is the last step's argmax
    grid_trigger()
    t = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if t < ids.shape[0] and src[t] >= 0:
        ids[t] = prev[src[t]]


_FEED: list = []


def feed_ids(ids, src, prev, stream=0) -> None:
    """ids[t] = prev[src[t]] where src[t] >= 0 (int32 device arrays; ids and src [T])."""
    if ids.shape[0] == 0:
        return
    if not _FEED:
        _FEED.append(cuda.jit(_feed_ids_kernel))
    _FEED[0][-(-ids.shape[0] // THREADS), THREADS, stream](ids, src, prev)


def feed_ids_ref(ids: np.ndarray, src: np.ndarray, prev: np.ndarray) -> np.ndarray:
    return np.where(src >= 0, prev[np.maximum(src, 0)], ids).astype(np.int32)
