"""The DFlash drafter on the device (metrale/spec/dflash_cuda.py) under the simulator: the whole
CudaBackend of a tiny dense model (sim_cuda_backend.py: driver calls on host memory, the matrix
products as host float64 stand-ins, every other kernel simulated) with its layer-row copies on.

- Drafts and confidences equal the NumPy DFlashDrafter's, fed the layer rows the device kept (the
  drafter's matrices rounded to bf16 as the device holds them, float64), over a prefill of two
  sequences, a verify-shaped step and a decode step; starts at every block offset, one pass part
  per sequence; the device pool's context K/V equals the NumPy projection (bf16).
- Greedy speculation through the Engine with spec.method=dflash on device=cuda (the device drafter
  chosen automatically, a random drafter) equals plain greedy decoding.
- The bundled SmolLM2-135M drafter's shapes (9 / 3 heads, fc over 3 layers, a 49,152-row LM head)
  on a stand-in target holding the shared buffers: drafts equal the NumPy drafter's."""
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kernels_numba.bf16 import SIMULATOR

pytestmark = pytest.mark.skipif(not SIMULATOR, reason="run with NUMBA_ENABLE_CUDASIM=1")

from numba import cuda  # noqa: E402

from kernels_numba.bf16 import bf16_round, from_bf16_bits, to_bf16_bits  # noqa: E402
from metrale import Engine, SamplingParams  # noqa: E402
from metrale.runtime.batch import Segment, build_batch  # noqa: E402
from metrale.settings import compose  # noqa: E402
from metrale.spec.dflash import DFlashDrafter, DFlashModel, random_tensors, read_drafter  # noqa: E402
from metrale.spec.dflash_cuda import DFlashCudaDrafter, DFlashCudaModel  # noqa: E402
from metrale.spec.mtp_cuda import head_config  # noqa: E402
from sim_cuda_backend import SIM_LEVERS, patch_backend, patch_products  # noqa: E402

BS = 4
SHAPE = dict(model_type="llama", vocab_size=192, num_attention_heads=2, num_key_value_heads=1,
             tie_word_embeddings=True, head_dim=64)


@pytest.fixture(autouse=True)
def _sim_backend(monkeypatch):
    patch_backend(monkeypatch)
    patch_products(monkeypatch)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from test_tp import write_checkpoint          # tests/ (the conftest's directory) is on sys.path
    return write_checkpoint(Path(tmp_path_factory.mktemp("dflash_cuda")) / "llama", SHAPE, seed=11, hidden=64,
                            ffn=128, layers=2)


def settings(path, *extra, tokens: int = 16) -> list[str]:
    return [f"model={path}", "device=cuda", f"cache.block_size={BS}", "cache.num_blocks=16", "scheduler.max_num_seqs=4",
            f"scheduler.max_num_batched_tokens={tokens}", "scheduler.max_model_len=32", "levers.graph_batch_sizes=[1,2,4]",
            *SIM_LEVERS, *extra]


def host_twin(f, shared: dict, num_blocks: int, num_drafts: int, dtype=np.float64) -> DFlashDrafter:
    """The NumPy drafter with the weights the device holds: matrices rounded to bf16."""
    w = {n: bf16_round(a) if np.ndim(a) == 2 else a for n, a in f.tensors.items()}
    model = DFlashModel(head_config(f.config, num_layers=f.num_layers), {**w, **shared}, target_layers=f.target_layers,
                        num_layers=f.num_layers, block_size=f.block_size, num_blocks=num_blocks, pool_block_size=BS,
                        dtype=dtype)
    return DFlashDrafter(model, num_drafts)


def seq(tokens, computed, table):
    toks = list(tokens)
    return SimpleNamespace(token_ids=toks, num_tokens=len(toks), num_computed_tokens=computed, block_table=list(table),
                           token_slice=lambda a, b: toks[a:b])


def compare(device: DFlashCudaDrafter, host: DFlashDrafter, seqs, ks) -> list:
    device.model.logits_log = []
    got, want = device.propose(seqs, ks), host.propose(seqs, ks)
    for g, w in zip(got, want):
        assert g.tokens == w.tokens, (g.tokens, w.tokens)
        np.testing.assert_allclose(g.confidences, w.confidences, rtol=5e-2, atol=2e-3)
    return got


def test_device_drafts_equal_the_numpy_drafter(ckpt):
    from metrale.models.checkpoint import load_hf_dir
    from metrale.runtime.cuda_backend import CudaBackend
    config, _, stream = load_hf_dir(ckpt)
    be = CudaBackend(config, stream(), cfg=compose(settings(ckpt, tokens=24)))
    f = random_tensors(config, target_layers=(0, 1), seed=5)
    device = DFlashCudaDrafter(DFlashCudaModel(be, f, length=3))
    assert device.model.per_pass == 2                       # 4 logits rows / 2 draft rows a block
    tap = device.tap(be)
    assert be.layer_rows is device.model.taps
    shared = {n: a for n, a in be.export_weights() if n in ("embed", "final_norm", "lm_head")}
    host = host_twin(f, shared, be.num_blocks, 2)
    D = config.hidden_size

    def forward(segs):
        batch = build_batch(segs, BS)
        ids = tap.forward_greedy(batch)
        rows = device.model.taps.matrix(0, batch.num_tokens).copy_to_host()
        host.model.store_rows(batch, [rows[:, j * D:(j + 1) * D] for j in range(2)])
        return ids

    r = np.random.default_rng(2)
    a_toks, b_toks, c_toks = list(r.integers(3, 192, 7)), list(r.integers(3, 192, 4)), list(r.integers(3, 192, 10))
    ta, tb, tc = [5, 9, 2], [7, 3], [11, 12, 13]
    ids = forward([Segment(np.array(a_toks, np.int32), 0, np.array(ta, np.int32), "last"),
                   Segment(np.array(b_toks, np.int32), 0, np.array(tb, np.int32), "last"),
                   Segment(np.array(c_toks, np.int32), 0, np.array(tc, np.int32), "last")])
    a_toks, b_toks, c_toks = a_toks + [int(ids[0])], b_toks + [int(ids[1])], c_toks + [int(ids[2])]
    # starts 7, 4 and 10 (block offsets 3, 0, 2); three sequences: two pass parts
    d = compare(device, host, [seq(a_toks, 7, ta), seq(b_toks, 4, tb), seq(c_toks, 10, tc)], [2, 2, 1])
    assert [len(x.tokens) for x in d] == [2, 2, 1] and len(device.model.logits_log) == 2
    # a verifies its 2 drafts (positions 7..9), the first accepted then a correction; b decodes position 4
    ids = forward([Segment(np.array([a_toks[-1]] + d[0].tokens, np.int32), 7, np.array(ta, np.int32), "all"),
                   Segment(np.array([b_toks[-1]], np.int32), 4, np.array(tb, np.int32), "last")])
    a_toks, b_toks = a_toks + [d[0].tokens[0], 100], b_toks + [int(ids[3])]
    compare(device, host, [seq(a_toks, 9, ta), seq(b_toks, 5, tb)], [2, 2])        # starts 9 and 5: offsets 1, 1
    # the context K/V of every position read equals the NumPy projection (bf16)
    host.model.catch_up([ta, tb], [9, 5])
    k_dev = from_bf16_bits(device.model.kv.k.copy_to_host())[0].reshape(-1, config.num_kv_heads, config.head_dim)
    k_host = host.model.kv.k[0].reshape(-1, config.num_kv_heads, config.head_dim)
    for table, n in ((ta, 9), (tb, 5)):
        slots = [table[p // BS] * BS + p % BS for p in range(n)]
        np.testing.assert_allclose(k_dev[slots], k_host[slots], rtol=2e-2, atol=2e-2)
    be.close()


def test_engine_greedy_dflash_equals_plain(ckpt):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 33, 60, 2, 17], [3, 14, 15]]
    plain = Engine(cfg=compose(settings(ckpt)))
    want = [o.token_ids.tolist() for o in plain.generate(prompts, params, use_tqdm=False)]
    plain.backend.close()
    eng = Engine(cfg=compose(settings(ckpt, "spec.method=dflash", "spec.num_drafts=2", "spec.dflash_head=random",
                                      "levers.spec_verify_cost=0")))
    drafter = eng.speculator.drafter
    assert isinstance(drafter, DFlashCudaDrafter) and eng.backend.layer_rows is drafter.model.taps
    got = [o.token_ids.tolist() for o in eng.generate(prompts, params, use_tqdm=False)]
    assert got == want
    st = eng.speculator.stats()
    assert st["verifies"] > 0 and st["proposed"] > 0
    eng.blocks.check_no_leaks([])
    eng.backend.close()


# ---------------------------------------------------------------------------- the bundled drafter's shapes
class SimTarget:
    """The attributes of a CudaBackend the drafter reads, on simulator arrays (no target forward:
    the test writes the layer rows itself)."""
    name = "cuda"

    def __init__(self, config, embed_bits: np.ndarray, final_norm: np.ndarray):
        from kernels_numba import gemm
        from metrale.models.rope import model_rope
        from metrale.runtime.cuda_backend import CudaOps
        self.config, self.block_size, self.num_blocks = config, BS, 24
        self.max_rows = self.max_seqs = 8
        self.max_tokens, self.max_model_len = 16, 64
        self.max_blocks = self.max_model_len // BS
        self.stream = SimpleNamespace(numba=0, handle=0, synchronize=lambda: None)
        self.weights = {"embed": cuda.to_device(embed_bits), "final_norm": cuda.to_device(final_norm)}
        cos, sin = model_rope(config).tables(self.max_model_len)
        self.cos, self.sin = cuda.to_device(cos.astype(np.float32)), cuda.to_device(sin.astype(np.float32))
        self.ops_class, self.use_graphs, self.graph_sizes, self.blas = CudaOps, False, [], None
        self.fuse_decode, self.prefetch_o_proj, self.flash_decode = True, False, False
        self.prefill_min_tokens, self.skinny_max_t = 16, gemm.FMA_MAX_T


def test_the_bundled_smollm2_drafter_shape(monkeypatch):
    from metrale.models.config import ModelConfig
    from metrale.runtime import cuda_backend
    from metrale.spec.dflash import DEFAULT_DRAFTERS
    path = DEFAULT_DRAFTERS["smollm2-135m-instruct"]
    if not path.is_file():
        pytest.skip("no bundled DFlash drafter")
    monkeypatch.setattr(cuda_backend, "_ptr", lambda a: a._ary.__array_interface__["data"][0])
    config = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                         num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                         rope_interleaved=True, tie_word_embeddings=True, max_position=8192, name="smollm2-135m-shape")
    f = read_drafter(path, config)
    assert f.target_layers == (1, 14, 27) and f.num_layers == 1
    r = np.random.default_rng(0)
    embed = to_bf16_bits((0.05 * r.standard_normal((config.vocab_size, config.hidden_size))).astype(np.float32))
    final_norm = (1 + 0.1 * r.standard_normal(config.hidden_size)).astype(np.float32)
    target = SimTarget(config, embed, final_norm)
    model = DFlashCudaModel(target, f, length=5)
    device = DFlashCudaDrafter(model)
    host = host_twin(f, {"embed": from_bf16_bits(embed), "final_norm": final_norm}, target.num_blocks, 4, np.float32)
    # one forward's layer rows (two sequences' prompts, 6 and 9 tokens): written on the device, stored on the host
    tables = [np.array([3, 7], np.int32), np.array([10, 11, 12], np.int32)]
    batch = build_batch([Segment(r.integers(0, 49152, 6).astype(np.int32), 0, tables[0], "last"),
                         Segment(r.integers(0, 49152, 9).astype(np.int32), 0, tables[1], "last")], BS)
    rows = (3 * r.standard_normal((batch.num_tokens, 3 * config.hidden_size))).astype(np.float32)
    model.taps.matrix(0, batch.num_tokens).copy_to_device(rows)
    model.write_context(batch)
    D = config.hidden_size
    host.model.store_rows(batch, [rows[:, j * D:(j + 1) * D] for j in range(3)])
    seqs = [seq(list(batch.token_ids[:6]) + [17], 6, tables[0]), seq(list(batch.token_ids[6:]) + [23], 9, tables[1])]
    d = compare(device, host, seqs, [4, 3])
    assert [len(x.tokens) for x in d] == [4, 3]
