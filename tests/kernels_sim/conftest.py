"""Simulator tests: run by tests/test_kernels_sim.py in a subprocess with NUMBA_ENABLE_CUDASIM=1.

The simulator runs each CUDA thread as a Python thread. Two patches of numba-cuda's simulator
(0.30) below make it several times cheaper without changing what a kernel computes: a block's
threads are kept in a pool across blocks and launches, and __syncthreads is a condition-variable
barrier (the stock BlockManager starts one OS thread per simulated thread per block, and polls
every thread in a loop that holds the GIL, so it needed a 0.1 ms switch interval to run at all).
"""
import os
import sys

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    # numba-cuda's simulator makes a shared array on first use with an unlocked get-then-set of its
    # per-block dict (kernelapi.FakeCUDAShared.array): two threads of a block can both miss and get
    # different "shared" arrays, and a block reduction then reads garbage (seen: test_bf16_sim's
    # argmax, a GDN clamp, a sampling threshold, about 1 run in 5 at a short switch interval).
    # The same lookup under a lock:
    import threading
    import traceback

    import numpy as _np
    from numba.core import types as _types
    from numba.cuda.simulator import kernel as _kernel
    from numba.cuda.simulator import kernelapi as _kernelapi
    from numba.np import numpy_support as _numpy_support

    _shared_lock = threading.Lock()
    _unlocked_array = _kernelapi.FakeCUDAShared.array

    def _locked_shared_array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:
            return _unlocked_array(self, shape, dtype, alignment)
        if isinstance(dtype, _types.Type):
            dtype = _numpy_support.as_dtype(dtype)
        caller = traceback.extract_stack(sys._getframe())[-2][0:2]
        with _shared_lock:
            res = self._allocations.get(caller)
            if res is None:
                res = _np.empty(shape, dtype)
                self._allocations[caller] = res
        return res

    _kernelapi.FakeCUDAShared.array = _locked_shared_array

    # ---- the block's threads and its barrier (BlockManager.run, BlockThread.syncthreads)
    # Same semantics as the stock simulator: blocks of a launch run one after another, a barrier
    # opens when every thread of the block that has not returned is waiting at it, an exception in
    # one thread aborts the others (their next barrier raises) and is raised by the launch with
    # the thread's tid / ctaid in its message.

    class _Block:
        """One block's run: its barrier (arrivals of this generation, threads still running)."""
        __slots__ = ("cv", "live", "arrived", "gen", "error", "threads")

        def __init__(self, threads):
            self.cv = threading.Condition(threading.Lock())
            self.live, self.arrived, self.gen, self.error, self.threads = len(threads), 0, 0, None, threads

        def open(self):             # self.cv held
            self.arrived = 0
            self.gen += 1
            self.cv.notify_all()

    def _syncthreads(self):
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads call")
        b = self._block
        with b.cv:
            b.arrived += 1
            if b.arrived == b.live:
                b.open()
            else:
                gen = b.gen
                while b.gen == gen and not self.abort:
                    b.cv.wait()
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads clear")

    class _Pool:
        """The simulated threads of every block of one size, waiting for the next block."""

        def __init__(self, n):
            self.cv = threading.Condition(threading.Lock())
            self.gen, self.job, self.dead = 0, None, False
            self.threads = [_PoolThread(self, i) for i in range(n)]
            for t in self.threads:
                t.start()

    class _PoolThread(_kernel.BlockThread):
        """A BlockThread (what cuda.threadIdx / syncthreads / kernels_numba.ptx's warp twins read
        through threading.current_thread()) that runs its lane of every block given to its pool."""

        def __init__(self, pool, index):
            threading.Thread.__init__(self, daemon=True)
            self.pool, self.index, self.debug = pool, index, False
            self.abort, self.exception, self.syncthreads_blocked = False, None, False

        def run(self):
            pool, gen = self.pool, 0
            while True:
                with pool.cv:
                    while pool.gen == gen and not pool.dead:
                        pool.cv.wait()
                    if pool.dead:
                        return
                    gen = pool.gen
                    manager, block, grid_point, point, fn, args = pool.job
                self._manager, self._block = manager, block
                self.blockIdx, self.threadIdx = _kernelapi.Dim3(*grid_point), _kernelapi.Dim3(*point[self.index])
                bd = manager._block_dim
                self.thread_id = self.threadIdx.x + bd[0] * (self.threadIdx.y + bd[1] * self.threadIdx.z)
                self.abort, self.exception = False, None
                try:
                    fn(*args)
                except Exception as e:              # as BlockThread.run words it
                    where = "tid=%s ctaid=%s" % (list(self.threadIdx), list(self.blockIdx))
                    self.exception = (type(e)(where if str(e) == "" else "%s: %s" % (where, e)), sys.exc_info()[2])
                with block.cv:
                    block.live -= 1
                    if self.exception is not None and block.error is None:
                        block.error = self.exception
                        for t in block.threads:
                            t.abort = True
                        block.cv.notify_all()
                    elif block.live == 0 or (block.arrived and block.arrived == block.live):
                        block.open()

    _pools = {}
    _stock_run = _kernel.BlockManager.run

    def _run_block(self, grid_point, *args):
        if self._debug:                         # debug=True kernels: the stock path (np.seterr per thread)
            return _stock_run(self, grid_point, *args)
        points = list(_np.ndindex(*self._block_dim))
        n = len(points)
        pool = _pools.get(n)
        if pool is None:
            pool = _pools[n] = _Pool(n)
        block = _Block(pool.threads)
        with pool.cv:
            pool.job = (self, block, grid_point, points, self._f, args)
            pool.gen += 1
            pool.cv.notify_all()
        with block.cv:
            while block.live and block.error is None:
                block.cv.wait()
            error = block.error
        if error is not None:                   # some threads may still be stuck (a warp barrier): new ones next time
            with pool.cv:
                pool.dead = True
                pool.cv.notify_all()
            del _pools[n]
            raise error[0].with_traceback(error[1])

    _kernel.BlockThread.syncthreads = _syncthreads
    _kernel.BlockManager.run = _run_block
