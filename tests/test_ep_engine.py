"""Expert parallelism through the Engine on CPU (parallel.expert=N, metrale/parallel/tp.py's
load_expert_rank, models/moe.py's reduce_local): every rank runs the step's whole batch with 1/N
of the routed experts, one all-reduce a MoE layer. Ranks as threads (FakeCommunicator): EP=2 and
EP=4 give EP=1's logits (float64, within 1e-10) and greedy ids on Qwen3-MoE and DeepSeek-V2
(MLA) conformance checkpoints, each rank holding only its experts; through Engine(...) the ranks
are processes and greedy text equals one rank's; what cannot split is refused, naming why."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from metrale import Engine, SamplingParams
from metrale.models.assemble import _load_hf
from metrale.parallel.comm import FakeWorld, run_ranks
from metrale.parallel.tp import TpLeader, load_rank
from metrale.runtime.batch import Segment, build_batch
from metrale.runtime.numpy_backend import NumpyBackend
from metrale.settings import compose
from test_tp import write_word_tokenizer

CONFORMANCE = Path(__file__).parent / "fixtures" / "conformance"
BS = 4


def with_tokenizer(src: Path, dst: Path) -> Path:
    """A copy of a conformance checkpoint with a word-level tokenizer over its vocabulary."""
    shutil.copytree(src, dst)
    return write_word_tokenizer(dst, json.loads((dst / "config.json").read_text())["vocab_size"])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    return {name: with_tokenizer(CONFORMANCE / name, root / name) for name in ("qwen3_moe", "deepseek_v2_greedy")}


def settings(path, world: int, **extra) -> list[str]:
    s = [f"model={path}", "device=cpu", f"parallel.expert={world}", "levers.numpy_dtype=float64",
         "levers.cpu_kernels=numpy", f"cache.block_size={BS}", "cache.num_blocks=48", "scheduler.max_num_seqs=4"]
    return s + [f"{k}={v}" for k, v in extra.items()]


def seg(ids, start, table, logits="last"):
    return Segment(np.array(ids, np.int32), start, np.array(table, np.int32), logits)


# a prefill with every row's logits and one with the last row's; then a decode row beside a prefill
# chunk without logits and a chunk after cached positions (a mixed step)
STEPS = [[seg([5, 9, 33, 60, 2, 17, 41, 8, 11], 0, [0, 1, 2], "all"), seg([3, 14, 15, 9, 26], 0, [3, 4])],
         [seg([12], 9, [0, 1, 2]), seg([40, 2, 7, 7], 0, [5, 6], "none"), seg([3, 3], 5, [3, 4], "all")]]


@pytest.mark.parametrize("name,world", [("qwen3_moe", 2), ("qwen3_moe", 4), ("deepseek_v2_greedy", 2)])
def test_ranks_give_one_rank_logits(ckpts, name, world):
    config, _, stream = _load_hf(ckpts[name])
    single = NumpyBackend(config, stream(), num_blocks=48, block_size=BS, dtype="float64")
    want = [single.forward(build_batch(s, BS)) for s in STEPS]
    cfg = compose(settings(ckpts[name], world))
    experts = config.n_routed_experts

    def fn(comm):
        _, _, rank = load_rank(cfg, comm)
        held = {n: a.shape[0] for n, a in rank.backend.weights.items() if n.endswith(".experts_gate_up")}
        if comm.rank:
            return rank.follow(), held, rank.backend.ep.reduces
        leader = TpLeader(rank)
        got = [(leader.forward(build_batch(s, BS)), leader.forward_greedy(build_batch(s, BS))) for s in STEPS]
        leader.close()
        return got, held, rank.backend.ep.reduces
    out = run_ranks(world, fn)
    for (logits, ids), ref in zip(out[0][0], want):
        np.testing.assert_allclose(logits, ref, rtol=0, atol=1e-10)
        assert ids.tolist() == np.argmax(ref, axis=-1).tolist()
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    for steps_or_got, held, reduces in out:
        assert held and all(n == experts // world for n in held.values())       # only this rank's experts
        assert reduces == 2 * len(STEPS) * moe_layers                              # one all-reduce a MoE layer
    assert all(o[0] == 2 * len(STEPS) for o in out[1:])                            # followers ran every step


def test_engine_with_two_expert_ranks_equals_one(ckpts):
    """Engine(..., parallel.expert=2): rank 0 in this process, rank 1 spawned; greedy ids equal one rank's."""
    path = ckpts["qwen3_moe"]
    prompts = ["w5 w9 w33 w60 w2 w17", "w3 w14 w15", "w40 w41 w42 w43 w44 w45 w46 w47 w48"]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    one = Engine(overrides=settings(path, 1))
    want = [o.token_ids.tolist() for o in one.generate(prompts, params, use_tqdm=False)]
    two = Engine(overrides=settings(path, 2))
    try:
        assert two.backend.memory_report()["expert_parallel"] == 2
        got = [o.token_ids.tolist() for o in two.generate(prompts, params, use_tqdm=False)]
    finally:
        two.backend.close()
    assert got == want


def test_what_cannot_split_is_refused(ckpts, tmp_path):
    comms = FakeWorld(3).communicators()
    with pytest.raises(ValueError, match="8 experts do not split evenly over 3 ranks"):
        load_rank(compose(settings(ckpts["qwen3_moe"], 3)), comms[0])
    with pytest.raises(ValueError, match="has no routed experts"):
        load_rank(compose(settings("tiny-shape", 3)), comms[0])
    with pytest.raises(ValueError, match="one kind of ranks at a time"):
        load_rank(compose(settings(ckpts["qwen3_moe"], 2, **{"parallel.tensor": 2})), FakeWorld(2).communicators()[0])
    with pytest.raises(ValueError, match="parallel.expert=2: Engine / load_model start the ranks"):
        from metrale.models.assemble import make_backend
        config, _, stream = _load_hf(ckpts["qwen3_moe"])
        make_backend("cpu", compose(settings(ckpts["qwen3_moe"], 2)), config, stream)


def test_cli_with_two_expert_ranks_prints_one_ranks_text(ckpts):
    import subprocess
    import sys
    run = lambda world: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "metrale", f"model={ckpts['qwen3_moe']}", "device=cpu", f"parallel.expert={world}",
         "prompt='w5 w9 w33'", "max_tokens=8", "stream=false"], capture_output=True, text=True, timeout=300)
    one, two = run(1), run(2)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    assert two.stdout.strip() == one.stdout.strip() and len(one.stdout.split()) == 8
    assert "on 2 CPU ranks" in two.stderr
