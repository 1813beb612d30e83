"""Tensor parallelism on the CUDA backend (metrale/runtime/cuda_tp.py) under the simulator: the
whole CudaBackend of each rank (sim_cuda_backend.py: the driver calls on host memory, the matrix
products as host stand-ins, every other kernel simulated), two ranks as threads joined by
FakeCommunicator, the device collectives host-staged (StagedCollectives; graphs off).

- the pick kernels (pack_pairs / pick_pairs) and the vocab-slice embedding against their references;
- prefill, decode and mixed steps: TP=2's gathered logits equal TP=1's CudaBackend within float32
  rounding, its device-picked greedy ids equal TP=1's argmax (one-row steps take the fused GEMV
  paths: rank 1's o / down products overwrite the residual, then the all-reduce); 2 all-reduces a
  layer + 1 and one all_gather a step, on every rank;
- greedy generation through the Engine (tp_engine, chunked prefill beside decode rows) equals the
  TP=1 Engine's tokens, on a tied-embedding model whose one KV head is replicated on both ranks."""
from pathlib import Path

import numpy as np
import pytest

from kernels_numba.bf16 import SIMULATOR

pytestmark = pytest.mark.skipif(not SIMULATOR, reason="run with NUMBA_ENABLE_CUDASIM=1")

from numba import cuda  # noqa: E402

from metrale import Engine, SamplingParams  # noqa: E402
from metrale.parallel.comm import run_ranks  # noqa: E402
from metrale.parallel.tp import TpLeader, load_rank, tp_engine  # noqa: E402
from metrale.runtime.batch import Segment, build_batch  # noqa: E402
from metrale.settings import compose  # noqa: E402
from sim_cuda_backend import SIM_LEVERS, patch_backend, patch_products  # noqa: E402

BS = 4
# vocabulary 192: slices of 96 ids, padded to 128 device rows on each rank
SHAPES = {"llama": dict(model_type="llama", vocab_size=192, num_attention_heads=2, num_key_value_heads=2,
                        tie_word_embeddings=False, head_dim=64),
          "qwen2": dict(model_type="qwen2", vocab_size=192, num_attention_heads=2, num_key_value_heads=1,
                        tie_word_embeddings=True, head_dim=64)}


@pytest.fixture(autouse=True)
def _sim_backend(monkeypatch):
    patch_backend(monkeypatch)
    patch_products(monkeypatch)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from test_tp import write_checkpoint          # tests/ (the conftest's directory) is on sys.path
    root = tmp_path_factory.mktemp("tp_cuda")
    return {name: write_checkpoint(Path(root) / name, shape, seed=i + 3, hidden=64, ffn=128, layers=2)
            for i, (name, shape) in enumerate(SHAPES.items())}


def settings(path, world: int, tokens: int = 16) -> list[str]:
    return [f"model={path}", "device=cuda", f"parallel.tensor={world}", f"cache.block_size={BS}", "cache.num_blocks=16",
            "scheduler.max_num_seqs=4", f"scheduler.max_num_batched_tokens={tokens}", "scheduler.max_model_len=32",
            "levers.graph_batch_sizes=[1,2,4]"] + SIM_LEVERS


def test_pick_kernels_and_slice_embedding():
    from kernels_numba import embedding, tp_pick
    from kernels_numba.bf16 import to_bf16_bits
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 128)).astype(np.float32)
    logits[1, 90:] = 50.0                                    # past the slice's 90 real columns: never picked
    idx = np.argmax(logits[:, :90], -1).astype(np.int32)
    pairs = cuda.to_device(np.zeros((3, 2), np.float32))
    tp_pick.pack_pairs(cuda.to_device(logits), cuda.to_device(idx), 90, 96, pairs)
    np.testing.assert_array_equal(pairs.copy_to_host(), tp_pick.pack_pairs_ref(logits, 90, 96))
    empty = cuda.to_device(np.zeros((3, 2), np.float32))
    tp_pick.pack_pairs(cuda.to_device(logits), cuda.to_device(idx), 0, 192, empty)
    np.testing.assert_array_equal(empty.copy_to_host(), tp_pick.pack_pairs_ref(logits, 0, 192))
    g = np.array([[[1.0, 5], [2.0, 7], [3.0, 1]], [[1.0, 99], [2.5, 120], [-np.inf, 192]]], np.float32)
    out = cuda.to_device(np.zeros(3, np.int32))
    tp_pick.pick_pairs(cuda.to_device(g), out)
    assert out.copy_to_host().tolist() == tp_pick.pick_pairs_ref(g).tolist() == [5, 120, 1]   # a tie: rank 0's
    table = to_bf16_bits(rng.standard_normal((64, 8)).astype(np.float32))
    ids = np.array([3, 40, 41, 100, -1, 95], np.int32)
    got = cuda.to_device(np.zeros((6, 8), np.float32))
    embedding.embedding_gather_slice(cuda.to_device(table), cuda.to_device(ids), 40, 96, got)
    np.testing.assert_array_equal(got.copy_to_host(), embedding.embedding_gather_slice_ref(table, ids, 40, 96))


def seg(ids, start, table, logits="last"):
    return Segment(np.array(ids, np.int32), start, np.array(table, np.int32), logits)


# (mode, segments): two prefills; two decode rows; a decode row beside a 3-token chunk with logits
# for all its rows; one decode row (the fused one-row paths)
STEPS = [("logits", [seg([5, 9, 33, 60, 2], 0, [0, 1]), seg([3, 14, 15], 0, [2])]),
         ("greedy", [seg([7], 5, [0, 1]), seg([8], 3, [2])]),
         ("logits", [seg([11], 6, [0, 1]), seg([150, 100, 42], 4, [2, 3], "all")]),
         ("greedy", [seg([12], 7, [0, 1])])]


def test_steps_equal_single_rank(ckpts):
    from metrale.models.checkpoint import load_hf_dir
    from metrale.runtime.cuda_backend import CudaBackend
    path = ckpts["llama"]
    config, _, stream = load_hf_dir(path)
    single = CudaBackend(config, stream(), cfg=compose(settings(path, 1)))
    want = [single.forward(build_batch(s, BS)) for _, s in STEPS]
    cfg = compose(settings(path, 2))

    def fn(comm):
        _, _, rank = load_rank(cfg, comm)
        assert not rank.backend.carry_norm_sums and not rank.backend.use_graphs
        if comm.rank:
            return rank.follow(), dict(rank.backend.collectives.calls)
        leader = TpLeader(rank)
        got = [leader.forward(build_batch(s, BS)) if mode == "logits" else leader.forward_greedy(build_batch(s, BS))
               for mode, s in STEPS]
        calls = dict(rank.backend.collectives.calls)
        leader.close()
        return got, calls
    out = run_ranks(2, fn, timeout=300)
    for (mode, _), got, ref in zip(STEPS, out[0][0], want):
        if mode == "logits":
            assert got.shape == ref.shape
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
        else:
            assert got.tolist() == np.argmax(ref, -1).tolist()
    layers, n = config.num_layers, len(STEPS)
    assert out[1][0] == n                                                   # the follower ran every step
    assert out[0][1] == out[1][1] == {"all_reduce": n * (2 * layers + 1), "all_gather": n}


def test_engine_greedy_equals_single_rank(ckpts):
    path = ckpts["qwen2"]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 33, 60, 2, 17], [3, 14, 15]]
    want = [o.token_ids.tolist() for o in Engine(cfg=compose(settings(path, 1, 8))).generate(prompts, params,
                                                                                              use_tqdm=False)]
    cfg = compose(settings(path, 2, 8))          # a budget of 8 tokens: the prompts' prefill is chunked

    def fn(comm):
        got = tp_engine(cfg, comm)
        if comm.rank:
            return got
        try:
            return [o.token_ids.tolist() for o in got.generate(prompts, params, use_tqdm=False)]
        finally:
            got.backend.close()
    out = run_ranks(2, fn, timeout=300)
    assert out[0] == want and all(len(t) == 3 for t in want)
    assert out[1] > 0
