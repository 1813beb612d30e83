"""flash_decode_attention (tensor-core decode) on the real GPU at model sizes, against
attention.paged_attention (the CUDA-core kernel) on every output and the float64 reference on a few
rows; prints both kernels' times (CUDA events, KV rotated past the L2; not asserted).
Run: pytest -m gpu tests/gpu/test_flash_decode_gpu.py -s   (~1-2 min, mostly JIT and the reference)"""
import math

import numpy as np
import pytest
from numba import cuda

from kernels_numba import attention as A
from kernels_numba import flash_decode as FD
from kernels_numba.bf16 import to_bf16_bits

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda.is_available(), reason="needs a CUDA GPU")]

BS = 16
SMOL = dict(name="smollm2", hq=9, hk=3, hd=64)
LLAMA = dict(name="llama3-8b", hq=32, hk=8, hd=128)


def make_batch(rng, shape, contexts, pad_rows=0):
    hq, hk, hd = shape["hq"], shape["hk"], shape["hd"]
    need = [(c + BS - 1) // BS for c in contexts]
    nb = sum(need) + 4
    perm = rng.permutation(nb).astype(np.int32)
    tables = np.full((len(contexts) + 1, max(need) + 2), -1, np.int32)  # last row: graph padding
    k = 0
    for s, m in enumerate(need):
        tables[s, :m] = perm[k:k + m]
        k += m
    kc = to_bf16_bits(rng.standard_normal((nb, BS, hk, hd), dtype=np.float32))
    vc = to_bf16_bits(rng.standard_normal((nb, BS, hk, hd), dtype=np.float32))
    positions = np.array([c - 1 for c in contexts] + [0] * pad_rows, np.int32)
    token_seq = np.array(list(range(len(contexts))) + [len(contexts)] * pad_rows, np.int32)
    q = rng.standard_normal((positions.shape[0], hq, hd), dtype=np.float32)
    return q, kc, vc, tables, token_seq, positions


@pytest.mark.parametrize("split", [False, True], ids=["nosplit", "split"])
@pytest.mark.parametrize("shape", [SMOL, LLAMA], ids=lambda s: s["name"])
def test_flash_decode_vs_paged_and_reference(shape, split):
    rng = np.random.default_rng(3)
    contexts = [1, 15, 16, 17, 200, 1000, 4097, 31, 8000] + list(rng.integers(1, 3000, 23))
    q, kc, vc, tables, token_seq, positions = make_batch(rng, shape, contexts, pad_rows=3)
    hq, hd = shape["hq"], shape["hd"]
    scale = 1.0 / math.sqrt(hd)
    max_ctx = 8192
    rows = A.paged_attention_scratch_shape(q.shape[0], hq, shape["hk"], hd, max_ctx)[0]
    d = [cuda.to_device(a) for a in (q, kc.view(np.uint64), vc.view(np.uint64), tables, token_seq, positions)]
    scr = cuda.to_device(np.zeros((max(rows, 16 * q.shape[0]), hq, hd + 2), np.float32)) if split else None
    d_fd = cuda.to_device(np.full_like(q, np.nan))
    d_pa = cuda.to_device(np.full_like(q, np.nan))
    FD.flash_decode_attention(*d, scale, d_fd, scratch=scr, max_context=max_ctx)
    A.paged_attention(*d, scale, d_pa, scratch=scr, max_context=max_ctx)
    out, ref = d_fd.copy_to_host(), d_pa.copy_to_host()
    n = len(contexts)
    assert np.isfinite(out).all()  # padding rows included
    rel = np.linalg.norm(out[:n] - ref[:n]) / np.linalg.norm(ref[:n])
    assert rel < 3e-3, rel
    assert np.abs(out[:n] - ref[:n]).max() < 3e-2
    pick = [0, 1, 3, 5, 6, 8]
    want = A.attention_ref(q[pick], kc, vc, tables, token_seq[pick], positions[pick], scale)
    rel = np.linalg.norm(out[pick] - want) / np.linalg.norm(want)
    assert rel < 3e-3, rel
    # forced split counts agree with the heuristic's answer
    if split:
        for parts in (2, 16):
            FD.flash_decode_attention(*d, scale, d_fd, scratch=scr, max_context=max_ctx, partitions=parts)
            o2 = d_fd.copy_to_host()
            assert np.abs(o2[:n] - out[:n]).max() < 1e-2, parts


def _time(fn, n_rot, iters=20):
    for i in range(3):
        fn(i % n_rot)
    cuda.synchronize()
    ev = [cuda.event() for _ in range(iters + 1)]
    ev[0].record()
    for i in range(iters):
        fn(i % n_rot)
        ev[i + 1].record()
    ev[-1].synchronize()
    return float(np.median([cuda.event_elapsed_time(ev[i], ev[i + 1]) for i in range(iters)]))


def test_flash_decode_timing():
    """Llama-3-8B shape, B = 1/32/128 x ctx 512/1024/4096: us and TB/s of K+V, both kernels."""
    from kernels_numba.random_init import fill_normal_bf16

    hq, hk, hd = LLAMA["hq"], LLAMA["hk"], LLAMA["hd"]
    rng = np.random.default_rng(0)
    scale = 1.0 / math.sqrt(hd)
    for ctx in (512, 1024, 4096):
        for batch in (1, 32, 128):
            kv = 2 * batch * ctx * hk * hd * 2
            n_rot = int(min(64, max(1, -(-240e6 // kv))))
            blocks = batch * (-(-ctx // BS))
            kc = cuda.device_array((blocks * n_rot, BS, hk, hd), np.uint16)
            vc = cuda.device_array((blocks * n_rot, BS, hk, hd), np.uint16)
            fill_normal_bf16(kc.reshape(kc.size), 1, 1.0)
            fill_normal_bf16(vc.reshape(vc.size), 2, 1.0)
            perm = rng.permutation(blocks * n_rot).astype(np.int32).reshape(n_rot, batch, -1)
            tabs = [cuda.to_device(np.ascontiguousarray(perm[r])) for r in range(n_rot)]
            q = cuda.to_device(rng.standard_normal((batch, hq, hd), dtype=np.float32))
            pos = cuda.to_device(np.full(batch, ctx - 1, np.int32))
            tseq = cuda.to_device(np.arange(batch, dtype=np.int32))
            out = cuda.device_array((batch, hq, hd), np.float32)
            scr = cuda.device_array((batch * 64, hq, hd + 2), np.float32)
            k64, v64 = kc.view(np.uint64), vc.view(np.uint64)
            res = {}
            for name, fn in (("paged", A.paged_attention), ("flash", FD.flash_decode_attention)):
                ms = _time(lambda i, fn=fn: fn(q, k64, v64, tabs[i], tseq, pos, scale, out, scratch=scr,
                                                max_context=ctx), n_rot)
                res[name] = ms
            fp = FD.flash_decode_partitions(batch, hk, ctx, FD.flash_decode_config(hd, hq // hk), scr.shape[0])[0]
            print(f"B={batch:<4d} ctx={ctx:<5d} paged {res['paged'] * 1e3:8.1f} us {kv / res['paged'] / 1e9:5.2f} TB/s"
                  f" | flash(parts={fp}) {res['flash'] * 1e3:8.1f} us {kv / res['flash'] / 1e9:5.2f} TB/s"
                  f" | x{res['paged'] / res['flash']:.2f}", flush=True)
            del kc, vc, tabs, scr
