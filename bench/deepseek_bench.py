"""DeepSeek kernels on one GPU at DeepSeek-V2-Lite's shapes (random data built on the device):
  MLA decode (mla_decode, 16 heads over the 576-wide bf16 latent cache) in tok/s against the
  latent-KV bandwidth bound (each sequence's latent rows read once per step);
  one MoE layer's decode (router GEMM + route + permute + grouped expert GEMMs + un-permute +
  2 shared experts) at batch 1 and 64 in tok/s against the weight-bandwidth bound (the distinct
  experts the batch routes to, the shared experts and the router read once).

    python -m bench.deepseek_bench --out docs/bench
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

HBM_BYTES_PER_S = 4.8e12         # H200 HBM3e
BS = 16


def _gpu_name() -> str:
    from numba import cuda
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def mla_decode_rate(batch: int, context: int, heads: int = 16, r: int = 512, rope: int = 64) -> tuple[float, float]:
    """(tok/s, bound tok/s) of one mla_decode launch per decode step of `batch` sequences."""
    from numba import cuda

    from bench.timing import time_launches
    from kernels_numba import mla
    from kernels_numba.random_init import fill_normal_bf16
    dk = r + rope
    per = -(-context // BS)
    cache = cuda.device_array((batch * per, BS, dk), np.uint16)
    fill_normal_bf16(cache.reshape(cache.size), 1, 1.0)
    tables = cuda.to_device(np.arange(batch * per, dtype=np.int32).reshape(batch, per))
    q = cuda.to_device(np.random.default_rng(0).standard_normal((batch, heads, dk)).astype(np.float32))
    out = cuda.device_array((batch, heads, r), np.float32)
    positions = cuda.to_device(np.full(batch, context - 1, np.int32))
    token_seq = cuda.to_device(np.arange(batch, dtype=np.int32))
    scratch = cuda.device_array(mla.mla_scratch_shape(batch, heads, dk, r, context), np.float32)
    cache32 = cache.view(np.uint32)
    ms = time_launches(lambda i: mla.mla_decode(q, cache32, tables, token_seq, positions, 0.07, out,
                                                scratch=scratch, max_context=context))
    bound_s = batch * context * dk * 2 / HBM_BYTES_PER_S
    return batch / (ms * 1e-3), batch / bound_s


def moe_layer_rate(batch: int, d: int = 2048, f: int = 1408, experts: int = 64, top_k: int = 6,
                   shared: int = 2) -> tuple[float, float, int]:
    """(tok/s, bound tok/s, distinct experts) of one MoE layer at `batch` decode rows."""
    from numba import cuda

    from bench.timing import time_launches
    from kernels_numba import activation, gemm, moe
    from kernels_numba.random_init import fill_normal_bf16
    rng = np.random.default_rng(1)

    def weights(shape, seed, std):
        w = cuda.device_array(shape, np.uint16)
        fill_normal_bf16(w.reshape(w.size), seed, std)
        return w

    router = weights((experts, d), 2, d ** -0.5)
    gu, down = weights((experts, 2 * f, d), 3, d ** -0.5), weights((experts, d, f), 4, f ** -0.5)
    sgu, sdown = weights((2 * f * shared, d), 5, d ** -0.5), weights((d, f * shared), 6, (f * shared) ** -0.5)
    h = cuda.to_device(rng.standard_normal((batch, d)).astype(np.float32))
    res = cuda.to_device(np.zeros((batch, d), np.float32))
    logits = cuda.device_array((batch, experts), np.float32)
    ids, wts = cuda.device_array((batch, top_k), np.int32), cuda.device_array((batch, top_k), np.float32)
    sg = cuda.device_array((batch, 2 * f * shared), np.float32)
    sa = cuda.device_array((batch, f * shared), np.float32)
    ws = moe.moe_workspace(batch, top_k, experts, d, f, device=True)
    cfg = moe.RouteConfig(experts, top_k)

    def layer(_):
        gemm.linear(h, router, logits)
        moe.route(logits, cfg, ids, wts)
        moe.moe_experts(h, ids, wts, gu, down, res, ws, accumulate=True)
        gemm.linear(h, sgu, sg)
        activation.silu_mul(sg, sa)
        gemm.linear_residual(sa, sdown, res)

    ms = time_launches(layer)
    distinct = len(np.unique(ids.copy_to_host()))
    nbytes = 2 * (distinct * 3 * d * f + 3 * d * f * shared + experts * d)
    return batch / (ms * 1e-3), batch / (nbytes / HBM_BYTES_PER_S), distinct


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="records directory (docs/bench) or .json file")
    args = ap.parse_args(argv)
    from bench.records import make_record, write_records
    gpu, cmd = _gpu_name(), "python -m bench.deepseek_bench " + " ".join(argv if argv is not None else sys.argv[1:])
    recs = []
    for batch, ctx in ((1, 4096), (64, 1024), (64, 4096)):
        rate, bound = mla_decode_rate(batch, ctx)
        print(f"mla_decode batch {batch} ctx {ctx}: {rate:,.0f} tok/s, latent-read bound {bound:,.0f} ({rate / bound:.0%})")
        recs.append(make_record("deepseek_kernels", f"mla decode tok/s, V2-Lite heads, batch {batch}, ctx {ctx}", rate,
                                "tok/s", bound, None, None, gpu, cmd, {"bound": "latent rows read once at 4.8 TB/s"}))
    for batch in (1, 64):
        rate, bound, distinct = moe_layer_rate(batch)
        print(f"moe layer batch {batch}: {rate:,.0f} tok/s, weight-read bound {bound:,.0f} ({rate / bound:.0%}), "
              f"{distinct} experts touched")
        recs.append(make_record("deepseek_kernels", f"moe layer decode tok/s, V2-Lite shape, batch {batch}", rate,
                                "tok/s", bound, None, None, gpu, cmd,
                                {"distinct_experts": distinct, "bound": "touched expert + shared + router weights at 4.8 TB/s"}))
    if args.out:
        print(write_records(recs, args.out, merge=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
