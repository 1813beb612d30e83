"""Host-side planning of the CUDA state pool (metrale/runtime/cuda/state_pool.py), on the CPU:
where prefix caching splits segments (as HostStatePool does), the pass metadata layout, and the
pool budget matching what Engine.__init__ reserves (so its reserve() moves nothing)."""
import numpy as np
from omegaconf import OmegaConf

from metrale.models.hybrid import hybrid_model_config
from metrale.runtime.cuda.state_pool import Reservation, budget, pass_arrays, pool_bytes, split_passes
from test_gdn import qwen3_next_cfg


def meta(lens, firsts):
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    positions = np.concatenate([np.arange(f, f + n) for f, n in zip(firsts, lens)]).astype(np.int32)
    return starts, positions


def test_split_points_follow_the_host_pool():
    starts, pos = meta([130, 4, 1, 60, 64], [10, 62, 63, 4, 64])
    slots = np.arange(5, dtype=np.int32)
    ckpts = np.array([-1, 5, -1, -1, -1], np.int32)
    pieces = split_passes(starts, pos, slots, ckpts, 64)
    assert pieces[0] == [(0, 54), (54, 118), (118, 130)]     # positions 10..140: cuts at 64 and 128
    assert pieces[1] == [(130, 134)]                          # a verify block is never split
    assert pieces[2] == [(134, 135)]                          # nor a decode row
    assert pieces[3] == [(135, 195)]                          # 4..63: no boundary inside
    assert pieces[4] == [(195, 259)]                          # 64..127 ends on 128: one piece
    assert split_passes(starts, pos, slots, ckpts, 0) == [[(a, b)] for a, b in zip(starts[:-1], starts[1:])]


def test_pass_arrays_cover_each_piece_once():
    starts, pos = meta([130, 3], [10, 0])
    slots = np.array([4, 2], np.int32)
    pieces = split_passes(starts, pos, slots, np.full(2, -1, np.int32), 64)
    seen = np.zeros(133, int)
    for k in range(3):
        sqs, sl = pass_arrays(pieces, slots, k)
        assert len(sqs) == len(sl) + 1 and (np.diff(sqs) >= 0).all()
        for e, slot in enumerate(sl):
            if slot >= 0:
                seen[sqs[e]:sqs[e + 1]] += 1
                assert slot == slots[e // 2]
    assert (seen == 1).all()


def test_budget_matches_the_engine_reservation():
    c = hybrid_model_config(qwen3_next_cfg())
    cfg = OmegaConf.create({"spec": {"method": "ngram", "num_drafts": 4},
                            "state": {"snapshots": 8, "norm_bound": 0.0}, "levers": {"prefix_caching": True}})
    nbytes, r = budget(c, cfg, num_slots=6, max_seqs=8, max_tokens=256, block_size=16)
    assert r == Reservation(num_checkpoints=6, max_trail=16, num_snapshots=8, snapshot_every=64, num_staging=8)
    cfg.spec.method, cfg.levers.prefix_caching = "none", False
    small, r0 = budget(c, cfg, num_slots=6, max_seqs=8, max_tokens=256, block_size=16)
    assert r0.num_checkpoints == r0.num_snapshots == r0.num_staging == 0 and small < nbytes
    assert nbytes >= pool_bytes(c, 6, r, 8, 256) and small >= 6 * c.state_bytes_per_slot(4)
