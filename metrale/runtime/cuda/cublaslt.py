"""cuBLASLt matmuls through nvmath-python's raw-pointer bindings, for the many-row linear layers.

    out[T, N] (float32) = x[T, K] (bf16) @ w[N, K].T (bf16)  [+ bias[N]]  [+ out, accumulate]

Row-major `out` is column-major `out.T` [N, T], so the call is cuBLAS's "TN" case:
D (N x T, ld N) = op(A) B with A = w read as column-major K x N (ld K) transposed, B = x read as
column-major K x T (ld K). bf16 inputs, fp32 compute, scale and output (a supported cuBLASLt
combination). Accumulate is beta = 1 with C = D (in place, same layout). Bias is the BIAS
epilogue (one fp32 value per row of D). A plan (descriptors + heuristic algorithm) is made once per
(T, N, K, accumulate, bias) and kept; the workspace is one device buffer given at construction, so
launches allocate nothing and can be captured in a CUDA graph.

Autotune (`autotune` candidates, for plans of at most `autotune_max_rows` rows, i.e. the decode and
verify ladder): the heuristic's top candidates are each timed on the call's own operands (output to
a scratch buffer, so the real output is untouched) and the fastest is kept. Each timed run starts
with the L2 flushed (a FLUSH_BYTES memset outside the events): a decode step streams its weights
from HBM, while back-to-back runs of one product keep a <= 50 MB weight (8B qkv, o_proj) in the
L2 and time a different kernel choice (session 5: the pick, and the 8B B=32 step with it, varied
between runs: 358 or 390 graph nodes, 5.68 or 5.78 ms). The heuristic's first
choice is often a split-K kernel plus a reduce launch for the skinny decode products (H200, 8B
shape, 32 rows: 2.5-2.8 TB/s on qkv/o_proj against 3.8 for gate_up). Plans first made while a stream
is being captured are not tuned (nothing may run then); the backend's eager warm-up run makes them
before every capture.

Picks on disk (`tune_cache`; the backend passes `levers.cublaslt_tune_cache`): each pick is kept in
a small JSON file (tune_cache.py, under ~/.cache/metrale/cublaslt/) keyed by the GPU (name,
compute capability, SM count), the driver, cuBLASLt and CUDA runtime versions, this module's
recipe (`RECIPE`, the workspace, the candidate count, split_k) and the product (T, N, K, accumulate,
bias). What is stored is the pick's index in the heuristic's list, the list's length and the picked
algorithm's configuration attributes (`ALGO_FIELDS`): the heuristic returns the same list for the
same descriptors on the same GPU and library, so a later start queries it again and takes the
stored index when the length and that candidate's attributes match, and times the candidates
otherwise. The opaque 64-byte algo struct itself is not stored: the re-query rebuilds it, and checks
that the library still offers it for these descriptors and this workspace. Deleting the directory
forgets every pick.

Optional: `available()` is False when nvmath-python or the cuBLASLt library is missing, and the
backend keeps its Numba kernels (the CPU machine and CI never load this).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from metrale.runtime.cuda.tune_cache import Pick, PickStore

log = logging.getLogger("metrale.cuda")

CUDA_R_32F = 0          # cudaDataType
CUDA_R_16BF = 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
WORKSPACE_BYTES = 32 << 20
FLUSH_BYTES = 192 << 20  # > 3x the H200's L2: written before each timed autotune run
MAX_PLANS = 512          # plans kept (LRU): eager prefill chunks of every length would grow it
# what a stored pick was tuned for besides the device and the shape: change it when the product's
# descriptors or the timing method change, so that older picks are timed again
RECIPE = "D=TN(A bf16,B bf16)->f32 compute32F bias-epilogue; cold-L2 median of 5"
# the algorithm configuration attributes a stored pick is checked against (its fingerprint)
ALGO_FIELDS = ("ID", "TILE_ID", "STAGES_ID", "SPLITK_NUM", "REDUCTION_SCHEME", "CTA_SWIZZLING",
               "CUSTOM_OPTION", "INNER_SHAPE_ID", "CLUSTER_SHAPE_ID")


def _lib() -> Any:
    from nvmath.bindings import cublasLt
    return cublasLt


def available() -> tuple[bool, str]:
    """(True, version) when nvmath-python imports and cuBLASLt loads, else (False, why)."""
    try:
        L = _lib()
        return True, f"cuBLASLt {L.get_version()}"
    except Exception as exc:  # ImportError, or the library not found by cuda-pathfinder
        return False, f"{type(exc).__name__}: {exc}"


def _check(ret: Any) -> Any:
    """cuda.bindings returns (CUresult, value...): raise on an error, return the value(s)."""
    err, *vals = ret if isinstance(ret, tuple) else (ret,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {int(err)}")
    return vals[0] if len(vals) == 1 else (tuple(vals) or None)


def _capturing(stream: int) -> bool:
    """Whether `stream` is being captured into a graph (then nothing may be timed or synchronized)."""
    from cuda.bindings import driver as drv
    status = _check(drv.cuStreamIsCapturing(stream))
    return int(status) != int(drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE)


@dataclass
class _Plan:
    desc: int
    layouts: tuple[int, int, int]     # A (weights), B (x), D (= C)
    algo: Any                         # MatmulHeuristicResult (keeps the algo struct alive)
    algo_ptr: int


class CublasLt:
    """One handle, one workspace, a cache of plans keyed by shape."""

    def __init__(self, workspace_ptr: int, workspace_bytes: int = WORKSPACE_BYTES, *,
                 autotune: int = 0, autotune_max_rows: int = 256, autotune_rows: set[int] | None = None,
                 split_k: bool = True, tune_cache: bool | str | os.PathLike = False) -> None:
        """autotune_rows: the only row counts tuned (the backend's CUDA-graph ladder, whose plans its
        warm-up makes before capture); None: every count up to autotune_max_rows. Other row counts
        (eager steps: short prompts, odd mixes) take the heuristic's first choice, so serving never
        stops to time candidates the first time a step of a new size runs. split_k=False: autotune
        skips split-K candidates (a second kernel, the reduce, a node more in a CUDA graph) unless
        every candidate is one. tune_cache: keep autotune picks on disk and take them at later
        starts (True: under ~/.cache/metrale/cublaslt; a path: that directory; False: time every
        start)."""
        self.L = L = _lib()
        self.autotune, self.autotune_max_rows = int(autotune), int(autotune_max_rows)
        self.autotune_rows = None if autotune_rows is None else {int(t) for t in autotune_rows}
        self.split_k = bool(split_k)
        self.tuned: dict[tuple, tuple[int, float, float]] = {}    # key -> (chosen index, its us, first's us)
        self.reused: dict[tuple, int] = {}                         # key -> index taken from the disk picks
        self.tune_cache = tune_cache
        self._store: PickStore | None = None
        self._scratch, self._scratch_bytes = 0, 0
        self.handle = L.create()
        self.workspace, self.workspace_bytes = int(workspace_ptr), int(workspace_bytes)
        self.plans: dict[tuple, _Plan] = {}
        self._one = np.ones(1, np.float32)
        self._zero = np.zeros(1, np.float32)
        self.pref = L.matmul_preference_create()
        ws = np.array([self.workspace_bytes], np.uint64)
        L.matmul_preference_set_attribute(self.pref, L.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES,
                                          ws.ctypes.data, ws.nbytes)

    def _set(self, desc: int, attr: Any, value: int, ctype: type = np.int32) -> None:
        buf = np.array([value], ctype)
        self.L.matmul_desc_set_attribute(desc, attr, buf.ctypes.data, buf.nbytes)

    def plan(self, T: int, N: int, K: int, accumulate: bool, bias: bool, tune_with: tuple | None = None) -> _Plan:
        """The cached plan of this shape, made on first use; tune_with = (x_ptr, w_ptr, bias_ptr,
        stream): operands to time the candidates on when autotuning applies."""
        key = (T, N, K, accumulate, bias)
        p = self.plans.pop(key, None)
        if p is not None:
            self.plans[key] = p               # most recently used last
            return p
        if len(self.plans) >= MAX_PLANS:
            self._destroy(self.plans.pop(next(iter(self.plans))))
        L = self.L
        desc = L.matmul_desc_create(CUBLAS_COMPUTE_32F, CUDA_R_32F)
        A = L.MatmulDescAttribute
        self._set(desc, A.TRANSA, CUBLAS_OP_T)
        self._set(desc, A.TRANSB, CUBLAS_OP_N)
        if bias:
            self._set(desc, A.EPILOGUE, int(L.Epilogue.BIAS), np.uint32)
            self._set(desc, A.BIAS_DATA_TYPE, CUDA_R_32F)
        a = L.matrix_layout_create(CUDA_R_16BF, K, N, K)
        b = L.matrix_layout_create(CUDA_R_16BF, K, T, K)
        d = L.matrix_layout_create(CUDA_R_32F, N, T, N)
        tune = (self.autotune > 1 and T <= self.autotune_max_rows and tune_with is not None
                and (self.autotune_rows is None or T in self.autotune_rows) and not _capturing(tune_with[3]))
        n = self.autotune if tune else 1
        result = L.MatmulHeuristicResult(n)
        count = np.zeros(1, np.int32)
        L.matmul_algo_get_heuristic(self.handle, desc, a, b, d, d, self.pref, n, result.ptr, count.ctypes.data)
        if count[0] < 1:
            raise RuntimeError(f"cuBLASLt has no algorithm for T={T} N={N} K={K}")
        pick = 0
        if tune and count[0] > 1:
            pick = self._pick(key, desc, (a, b, d), result, int(count[0]), tune_with)
        # the algo is the struct's first member; the result array stays referenced by the plan
        p = _Plan(desc, (a, b, d), result, int(result[pick].ptr) if n > 1 else int(result.ptr))
        self.plans[key] = p
        return p

    def _pick(self, key: tuple, desc: int, layouts: tuple, result: Any, count: int, tune_with: tuple) -> int:
        """The stored pick of this product when it still applies, else the fastest (then stored)."""
        store = self._pick_store()
        name = "{}x{}x{} acc={:d} bias={:d}".format(*key)
        if store is not None:
            index = store.resolve(name, count, lambda i: self._fingerprint(int(result[i].ptr)))
            if (index is not None and int(result[index].state) == 0
                    and int(result[index].workspace_size) <= self.workspace_bytes):
                self.reused[key] = index
                return index
        pick = self._fastest(key, desc, layouts, result, count, tune_with)
        if store is not None and np.isfinite(self.tuned[key][1]):
            store.put(name, Pick(pick, count, self._fingerprint(int(result[pick].ptr))))
        return pick

    def _pick_store(self) -> PickStore | None:
        """The disk picks of this GPU, libraries and setup (made on first use; None when off or
        when the device cannot be described)."""
        if self._store is None and self.tune_cache is not False:
            try:
                directory = None if self.tune_cache is True else self.tune_cache
                self._store = PickStore(self._context(), directory)
            except Exception as exc:  # no disk picks: the candidates are timed
                log.debug("cuBLASLt picks off: %s", exc)
                self.tune_cache = False
        return self._store

    def _context(self) -> dict:
        """What the picks depend on besides the product: the GPU, the driver and libraries, the
        tuning setup."""
        from cuda.bindings import driver as drv
        dev = _check(drv.cuCtxGetDevice())
        A = drv.CUdevice_attribute
        name = _check(drv.cuDeviceGetName(256, dev))
        name = name.split(b"\0")[0].decode(errors="replace") if isinstance(name, bytes) else str(name)
        try:
            cudart = int(self.L.get_cudart_version())
        except Exception:  # an older binding
            cudart = 0
        return {"gpu": name.strip(),
                "cc": [int(_check(drv.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))),
                       int(_check(drv.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)))],
                "sms": int(_check(drv.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev))),
                "driver": int(_check(drv.cuDriverGetVersion())),
                "cublaslt": int(self.L.get_version()), "cudart": cudart,
                "recipe": RECIPE, "workspace": self.workspace_bytes, "candidates": self.autotune,
                "split_k": self.split_k}

    def _fingerprint(self, algo_ptr: int) -> tuple[int, ...]:
        """The algorithm's configuration attributes (ALGO_FIELDS; -1 where one is unknown)."""
        L, out = self.L, []
        for field in ALGO_FIELDS:
            attr = getattr(L.MatmulAlgoConfigAttribute, field, None)
            value = -1
            if attr is not None:
                try:
                    buf = np.zeros(1, L.get_matmul_algo_config_attribute_dtype(int(attr)))
                    written = np.zeros(1, np.uint64)
                    L.matmul_algo_config_get_attribute(algo_ptr, int(attr), buf.ctypes.data, buf.nbytes,
                                                       written.ctypes.data)
                    value = int(buf[0])
                except Exception:  # not readable with this library
                    value = -1
            out.append(value)
        return tuple(out)

    def _fastest(self, key: tuple, desc: int, layouts: tuple, result: Any, count: int, tune_with: tuple) -> int:
        """Index of the fastest of `count` candidates, timed on the given operands (median of 5 runs
        after one warm-up each) into a scratch output; candidates that fail to run are skipped."""
        from cuda.bindings import driver as drv
        T, N, K, accumulate, bias = key
        x_ptr, w_ptr, bias_ptr, stream = tune_with
        a, b, d = layouts
        scratch = self._scratch_for(T * N * 4)
        try:                          # no room left for the flush buffer (a full KV pool): time warm
            flush = int(_check(drv.cuMemAlloc(FLUSH_BYTES)))
        except RuntimeError:
            flush = 0
        if bias:
            self._set(desc, self.L.MatmulDescAttribute.BIAS_POINTER, bias_ptr, np.uint64)
        beta = self._one if accumulate else self._zero
        start, stop = (_check(drv.cuEventCreate(0)) for _ in range(2))
        times = []
        try:
            splits = [self._split_k_num(int(result[i].ptr)) if not self.split_k else 1 for i in range(count)]
            skip_split = not self.split_k and any(s <= 1 for s in splits)
            for i in range(count):
                algo = int(result[i].ptr)
                if (int(result[i].state) != 0 or int(result[i].workspace_size) > self.workspace_bytes
                        or (skip_split and splits[i] > 1)):
                    times.append(float("inf"))
                    continue
                runs = []
                try:
                    for r in range(6):
                        if flush:
                            _check(drv.cuMemsetD8Async(flush, r, FLUSH_BYTES, stream))   # cold L2, as in a step
                        _check(drv.cuEventRecord(start, stream))
                        self.L.matmul(self.handle, desc, self._one.ctypes.data, w_ptr, a, x_ptr, b,
                                      beta.ctypes.data, scratch, d, scratch, d, algo, self.workspace,
                                      self.workspace_bytes, stream)
                        _check(drv.cuEventRecord(stop, stream))
                        _check(drv.cuEventSynchronize(stop))
                        if r:
                            runs.append(_check(drv.cuEventElapsedTime(start, stop)) * 1e3)
                    times.append(float(np.median(runs)))
                except Exception:      # this algorithm cannot run these operands: skip it
                    times.append(float("inf"))
        finally:
            for e in (start, stop):
                drv.cuEventDestroy(e)
            _check(drv.cuStreamSynchronize(stream))
            if flush:
                drv.cuMemFree(flush)
        pick = int(np.argmin(times))
        if not np.isfinite(times[pick]):
            pick = 0
        self.tuned[key] = (pick, times[pick], times[0])
        return pick

    def _split_k_num(self, algo_ptr: int) -> int:
        """The candidate's split-K factor (1: one kernel; unreadable: 1)."""
        buf, written = np.zeros(1, np.int32), np.zeros(1, np.uint64)
        try:
            self.L.matmul_algo_config_get_attribute(algo_ptr, int(self.L.MatmulAlgoConfigAttribute.SPLITK_NUM),
                                                    buf.ctypes.data, 4, written.ctypes.data)
        except Exception:
            return 1
        return max(1, int(buf[0]))

    def _scratch_for(self, nbytes: int) -> int:
        """A device buffer of at least nbytes for tuning outputs (grown on demand, freed at close)."""
        from cuda.bindings import driver as drv
        if nbytes > self._scratch_bytes:
            if self._scratch:
                _check(drv.cuMemFree(self._scratch))
            self._scratch = int(_check(drv.cuMemAlloc(nbytes)))
            self._scratch_bytes = nbytes
        return self._scratch

    def linear(self, x_bf16_ptr: int, w_ptr: int, out_ptr: int, T: int, N: int, K: int, *,
               bias_ptr: int = 0, accumulate: bool = False, stream: int = 0) -> None:
        p = self.plan(T, N, K, accumulate, bool(bias_ptr), (x_bf16_ptr, w_ptr, bias_ptr, stream))
        if bias_ptr:
            self._set(p.desc, self.L.MatmulDescAttribute.BIAS_POINTER, bias_ptr, np.uint64)
        a, b, d = p.layouts
        beta = self._one if accumulate else self._zero
        self.L.matmul(self.handle, p.desc, self._one.ctypes.data, w_ptr, a, x_bf16_ptr, b,
                      beta.ctypes.data, out_ptr, d, out_ptr, d, p.algo_ptr, self.workspace,
                      self.workspace_bytes, stream)

    def _destroy(self, p: _Plan) -> None:
        for lay in p.layouts:
            self.L.matrix_layout_destroy(lay)
        self.L.matmul_desc_destroy(p.desc)

    def close(self) -> None:
        L = self.L
        for p in self.plans.values():
            self._destroy(p)
        self.plans.clear()
        if self._scratch:
            from cuda.bindings import driver as drv
            drv.cuMemFree(self._scratch)
            self._scratch = 0
        L.matmul_preference_destroy(self.pref)
        L.destroy(self.handle)

