"""GGUF block-quantized weights repacked once at load into the planes the quantized kernels read,
and the NumPy references those kernels are checked against.

Every type is seen as groups of 32 consecutive values of a row (k = 32g .. 32g + 31) with an
unsigned code q per value (Q8_0: a signed int8) and the type's scales:

  Q4_0  w = d (q - 8)            Q4_1  w = d q + m           Q8_0  w = d q (q int8)
  Q5_0  w = d (q - 16)           Q5_1  w = d q + m
  Q4_K / Q5_K  w = d sc_j q - dmin m_j   (super-blocks of 256 = 8 groups j, 6-bit sc_j / m_j)
  Q6_K  w = d s_i (q - 32)               (super-blocks of 256, int8 scale s_i per 16 values)

Planes (uint8 [rows, bytes a row]; absent planes are None). Bytes add up to the file's exactly.
  qs  low 4 bits, 16 bytes a group: byte b holds value b (low nibble) and value 16 + b (high
      nibble), so the 32-bit word w = 0..3 of a group gives, masked with 0x0F0F0F0F, the values
      4w..4w+3 and, shifted by 4, the values 16+4w..16+4w+3: the byte order of dp4a operands
      against an int8 activation vector in natural order. Q8_0: the 32 int8 values, as two
      16-byte halves in two half-planes (half h of group g at byte (h G + g) 16).
  qh  Q5_*: bit 4 of the code, 4 bytes a group: value v = 16h + 4w + b at bit 8b + 4h + w (a shift
      by a constant and a mask put it at bit 4 of byte b of operand word (h, w)).
      Q6_K: bits 4..5, 8 bytes a group: word h, bits 8b + 2w .. 8b + 2w + 1 for value 16h + 4w + b.
  sc  Q4_K / Q5_K: the block's first 16 bytes as the file has them (d, dmin fp16; 12 bytes of
      6-bit scales and mins), one a super-block. Q6_K: its 16 int8 scales, one a super-block.
  dm  Q4_0 / Q5_0 / Q8_0: fp16 d a group; Q4_1 / Q5_1: fp16 d, m a group; Q6_K: fp16 d a super-block.

Order of groups. Legacy types: natural (group g at g). K-quants: a kernel lane takes a whole
super-block s, so its 8 groups j are spread for coalescing: group 8s + j of qs at position
j NSB + s (16 bytes each: lanes of consecutive s read consecutive 16 bytes); qh of Q5_K in 16-byte
quads (groups 4jq..4jq+3 of super-block s at (jq NSB + s) 16); qh of Q6_K in 16-byte pairs
(groups 2jp, 2jp+1 at (jp NSB + s) 16); sc and dm by super-block.

Activations (the GEMV's x) are quantized per group of 32 as llama.cpp's q8_1 does: d8 = amax / 127,
q = rint(x * (127 / amax)) (float32 arithmetic, ties to even). `q8_quantize` is the exact emulation
of the kernels' arithmetic; the product reference is float64 W @ x_hat.
"""
from __future__ import annotations

import numpy as np

# ggml type ids (gguf.GGMLQuantizationType values)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
KQUANTS = (Q4_K, Q5_K, Q6_K)
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0",
         Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
BLOCK = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
         Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
PLANES = ("qs", "qh", "sc", "dm")

# value v = 16h + 4w + b of a group: its half h, operand word w, byte b
_V = np.arange(32)
_H, _W, _B = _V // 16, (_V % 16) // 4, _V % 4


def block_of(qtype: int) -> int:
    """Values a unit of the kernels covers: a group (32) or a super-block (256)."""
    return 256 if qtype in KQUANTS else 32


def check_shape(qtype: int, rows: int, cols: int) -> None:
    if qtype not in BLOCK:
        raise ValueError(f"ggml type {qtype} is not one of {', '.join(NAMES.values())}")
    if cols % BLOCK[qtype][0]:
        raise ValueError(f"{NAMES[qtype]}: {cols} columns is not a multiple of {BLOCK[qtype][0]}")


# ----------------------------------------------------------------------------- file blocks -> codes
def _codes(qtype: int, data: np.ndarray, cols: int) -> dict:
    """The file's blocks as groups: q [rows, G, 32] (uint8 codes; Q8_0 int8 bits) and the scale
    fields as byte arrays."""
    rows = data.shape[0]
    bsize, nbytes = BLOCK[qtype]
    blk = np.ascontiguousarray(data).reshape(rows, cols // bsize, nbytes)
    if qtype not in KQUANTS:
        if qtype == Q8_0:
            return {"q": blk[..., 2:34].copy(), "d": blk[..., 0:2].copy()}
        off = {Q4_0: 2, Q4_1: 4, Q5_0: 2, Q5_1: 4}[qtype]
        qh = None
        if qtype in (Q5_0, Q5_1):
            qh = blk[..., off:off + 4].copy().view(np.uint32)[..., 0]
            off += 4
        qs = blk[..., off:off + 16]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.uint8)
        if qh is not None:
            q |= (((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4)
        out = {"q": q, "d": blk[..., 0:2].copy()}
        if qtype in (Q4_1, Q5_1):
            out["m"] = blk[..., 2:4].copy()
        return out
    nsb = cols // 256
    if qtype == Q6_K:
        ql, qh = blk[..., 0:128], blk[..., 128:192]
        q = np.empty((rows, nsb, 256), np.uint8)
        for c in range(2):
            lo = ql[..., 64 * c:64 * c + 64]
            q[..., 128 * c:128 * c + 64] = lo & 0x0F
            q[..., 128 * c + 64:128 * c + 128] = lo >> 4
            h = qh[..., 32 * c:32 * c + 32]
            for s in range(4):
                q[..., 128 * c + 32 * s:128 * c + 32 * s + 32] |= ((h >> (2 * s)) & 3) << 4
        return {"q": q.reshape(rows, nsb * 8, 32), "scales": blk[..., 192:208].copy(),
                "d": blk[..., 208:210].copy()}
    qs = blk[..., 16:144] if qtype == Q4_K else blk[..., 48:176]
    q = np.empty((rows, nsb, 256), np.uint8)
    for c in range(4):
        b = qs[..., 32 * c:32 * c + 32]
        q[..., 64 * c:64 * c + 32] = b & 0x0F
        q[..., 64 * c + 32:64 * c + 64] = b >> 4
    if qtype == Q5_K:
        qh = blk[..., 16:48]
        for j in range(8):
            q[..., 32 * j:32 * j + 32] |= ((qh >> j) & 1) << 4
    return {"q": q.reshape(rows, nsb * 8, 32), "header": blk[..., 0:16].copy()}


def _kq_order(a: np.ndarray, nsb: int) -> np.ndarray:
    """[rows, G, ...] in natural group order -> [rows, G, ...] in position order j NSB + s."""
    rows = a.shape[0]
    return np.ascontiguousarray(a.reshape((rows, nsb, 8) + a.shape[2:]).swapaxes(1, 2)).reshape(a.shape)


def repack(qtype: int, data: np.ndarray, cols: int) -> dict:
    """The file's block bytes uint8 [rows, cols / block * block_bytes] -> the kernels' planes."""
    rows = data.shape[0]
    check_shape(qtype, rows, cols)
    want = (rows, cols // BLOCK[qtype][0] * BLOCK[qtype][1])
    if data.dtype != np.uint8 or data.shape != want:
        raise ValueError(f"{NAMES[qtype]}: data must be uint8 {want}, got {data.dtype} {data.shape}")
    f = _codes(qtype, data, cols)
    q = f["q"]
    G = cols // 32
    nsb = cols // 256
    kq = qtype in KQUANTS
    planes = dict.fromkeys(PLANES)
    if qtype == Q8_0:
        planes["qs"] = np.ascontiguousarray(q.reshape(rows, G, 2, 16).swapaxes(1, 2)).reshape(rows, G * 32)
    else:
        lo = q & 0x0F
        qs = (lo[..., :16] | (lo[..., 16:] << 4)).astype(np.uint8)          # [rows, G, 16]
        planes["qs"] = (_kq_order(qs, nsb) if kq else qs).reshape(rows, G * 16)
    if qtype in (Q5_0, Q5_1, Q5_K):
        hb = ((q >> 4) & 1).astype(np.uint32)
        H = (hb << (8 * _B + 4 * _H + _W).astype(np.uint32)).sum(-1, dtype=np.uint32)   # [rows, G]
        if qtype == Q5_K:   # [rows, nsb, 2 (jq), 4 (e)] -> [rows, jq, nsb, e]
            H = np.ascontiguousarray(H.reshape(rows, nsb, 2, 4).swapaxes(1, 2))
        planes["qh"] = H.reshape(rows, -1).view(np.uint8).reshape(rows, -1)
    if qtype == Q6_K:
        h2 = ((q >> 4) & 3).astype(np.uint32).reshape(rows, G, 2, 16)
        sh = (8 * _B[:16] + 2 * _W[:16]).astype(np.uint32)
        H = (h2 << sh).sum(-1, dtype=np.uint32)                               # [rows, G, 2]
        H = np.ascontiguousarray(H.reshape(rows, nsb, 4, 2, 2).swapaxes(1, 2))  # [rows, jp, nsb, j&1, h]
        planes["qh"] = H.reshape(rows, -1).view(np.uint8).reshape(rows, -1)
        planes["sc"] = f["scales"].reshape(rows, nsb * 16)
        planes["dm"] = f["d"].reshape(rows, nsb * 2)
    elif kq:
        planes["sc"] = f["header"].reshape(rows, nsb * 16)
    elif qtype in (Q4_1, Q5_1):
        planes["dm"] = np.concatenate([f["d"], f["m"]], axis=-1).reshape(rows, G * 4)
    else:
        planes["dm"] = f["d"].reshape(rows, G * 2)
    return {k: (None if v is None else np.ascontiguousarray(v, dtype=np.uint8)) for k, v in planes.items()}


def plane_bytes(planes: dict) -> int:
    return sum(v.nbytes for v in planes.values() if v is not None)


# ----------------------------------------------------------------------------- planes -> float (reference)
def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def kq_scale_min(header: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """6-bit scales and mins [..., 8] of Q4_K / Q5_K headers [..., 16] (d, dmin, 12 bytes)."""
    s = header[..., 4:16].astype(np.int32)
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([a & 63, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    return sc, mn


def dequant_planes(qtype: int, planes: dict, cols: int) -> np.ndarray:
    """float32 [rows, cols] from the planes, decoded as the kernels decode them (the repack's test:
    equal to gguf's dequantization of the file bytes)."""
    qs = planes["qs"]
    rows = qs.shape[0]
    G, nsb = cols // 32, cols // 256
    kq = qtype in KQUANTS

    def natural(a):             # position order -> natural group order (K-quants)
        return np.ascontiguousarray(a.reshape((rows, 8, nsb) + a.shape[2:]).swapaxes(1, 2)).reshape(a.shape) if kq else a

    if qtype == Q8_0:
        q = np.ascontiguousarray(qs.reshape(rows, 2, G, 16).swapaxes(1, 2)).reshape(rows, G, 32).view(np.int8)
        return (_f16(planes["dm"].reshape(rows, G, 2))[..., 0:1] * q.astype(np.float32)).reshape(rows, cols)
    b = natural(qs.reshape(rows, G, 16))
    q = np.concatenate([b & 0x0F, b >> 4], axis=-1).astype(np.int32)       # [rows, G, 32]
    if qtype in (Q5_0, Q5_1, Q5_K):
        H = planes["qh"].view(np.uint32).reshape(rows, -1)
        if qtype == Q5_K:
            H = np.ascontiguousarray(H.reshape(rows, 2, nsb, 4).swapaxes(1, 2)).reshape(rows, G)
        q |= (((H[..., None] >> (8 * _B + 4 * _H + _W).astype(np.uint32)) & 1) << 4).astype(np.int32)
    if qtype == Q6_K:
        H = planes["qh"].view(np.uint32).reshape(rows, 4, nsb, 2, 2)
        H = np.ascontiguousarray(H.swapaxes(1, 2)).reshape(rows, G, 2)
        q |= (((H[..., _H] >> (8 * _B + 2 * _W).astype(np.uint32)) & 3) << 4).astype(np.int32)
        s = planes["sc"].reshape(rows, nsb, 16).view(np.int8).astype(np.float32)
        d = _f16(planes["dm"].reshape(rows, nsb, 2))                          # [rows, nsb, 1]
        dl = (d * s).reshape(rows, G, 2, 1)
        return (dl * (q - 32).reshape(rows, G, 2, 16).astype(np.float32)).reshape(rows, cols)
    qf = q.astype(np.float32)
    if kq:
        hd = planes["sc"].reshape(rows, nsb, 16)
        d, dmin = _f16(hd[..., 0:2]), _f16(hd[..., 2:4])
        sc, mn = kq_scale_min(hd)
        dl = (d * sc.astype(np.float32)).reshape(rows, G, 1)
        ml = (dmin * mn.astype(np.float32)).reshape(rows, G, 1)
        return (dl * qf - ml).reshape(rows, cols)
    dm = planes["dm"].reshape(rows, G, -1)
    d = _f16(dm[..., 0:2])
    if qtype in (Q4_1, Q5_1):
        return (d * qf + _f16(dm[..., 2:4])).reshape(rows, cols)
    off = np.float32(8 if qtype == Q4_0 else 16)
    return (d * (qf - off)).reshape(rows, cols)


def gguf_dequantize(qtype: int, data: np.ndarray) -> np.ndarray:
    """The independent reference: gguf's dequantization of the file's block bytes, float32."""
    import gguf
    return np.ascontiguousarray(gguf.quants.dequantize(data, gguf.GGMLQuantizationType(qtype)), np.float32)


# ----------------------------------------------------------------------------- activations, products
def q8_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x float32 [T, K] -> (q int8 [T, K], d8 float32 [T, K / 32]) as the kernels compute them."""
    x = np.ascontiguousarray(x, np.float32)
    T, K = x.shape
    g = x.reshape(T, K // 32, 32)
    amax = np.abs(g).max(-1)
    d8 = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint((g * inv[..., None]).astype(np.float32)).astype(np.int8)
    return q.reshape(T, K), d8


def q8_dequantize(q: np.ndarray, d8: np.ndarray) -> np.ndarray:
    T, K = q.shape
    return (q.reshape(T, K // 32, 32).astype(np.float64) * d8[..., None].astype(np.float64)).reshape(T, K)


def gemv_ref(x: np.ndarray, w: np.ndarray, bias=None, residual=None) -> np.ndarray:
    """float64 x_hat @ w.T (+ bias) (+ residual), x_hat = x through q8_quantize: what the GEMV
    computes, exactly but for float32 rounding. w: the dequantized weight [N, K]."""
    y = q8_dequantize(*q8_quantize(x)) @ np.asarray(w, np.float64).T
    if bias is not None:
        y = y + np.asarray(bias, np.float64)
    if residual is not None:
        y = y + np.asarray(residual, np.float64)
    return y


# ----------------------------------------------------------------------------- test data
def random_blocks(qtype: int, rows: int, cols: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Random file bytes of a type, uint8 [rows, bytes a row]: random codes and scale bits, with the
    fp16 scales drawn as finite values of a weight-like size (every code and scale bit pattern the
    kernels must decode occurs)."""
    check_shape(qtype, rows, cols)
    bsize, nbytes = BLOCK[qtype]
    nb = rows * (cols // bsize)
    blk = rng.integers(0, 256, (nb, nbytes), dtype=np.uint8)

    def f16(n, lo, hi):
        v = (rng.uniform(lo, hi, n) * rng.choice([-1, 1], n) * scale).astype(np.float16)
        return v.view(np.uint8).reshape(n, 2)

    if qtype in KQUANTS:
        if qtype == Q6_K:
            blk[:, 208:210] = f16(nb, 1e-3, 4e-3)
        else:
            blk[:, 0:2] = np.abs(f16(nb, 1e-3, 4e-3).view(np.float16)).view(np.uint8)
            blk[:, 2:4] = np.abs(f16(nb, 1e-3, 8e-3).view(np.float16)).view(np.uint8)
    else:
        blk[:, 0:2] = f16(nb, 5e-3, 2e-2)
        if qtype in (Q4_1, Q5_1):
            blk[:, 2:4] = f16(nb, 0.02, 0.1)
    return blk.reshape(rows, -1)
