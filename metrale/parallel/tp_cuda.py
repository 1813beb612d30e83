"""A tensor-parallel rank on the CUDA backend (parallel.tensor=N device=cuda): which GPU each rank
process gets, its device collectives (NCCL when rank 0 handed out a unique id, else staged through
the host communicator: tests, the simulator) and its backend (metrale/runtime/cuda_tp.py).
The step loop is tp.py's (TPRank / TpLeader), the host-side plan broadcast on the host
communicator (queues between the rank processes), so the host never waits on NCCL's stream for it.
"""
from __future__ import annotations

import os

import numpy as np

from metrale.models.checkpoint import WeightStream
from metrale.parallel.collectives import DeviceCollectives, NcclCollectives, StagedCollectives
from metrale.parallel.comm import Communicator, all_gather


def rank_devices(world: int) -> list[str]:
    """The CUDA_VISIBLE_DEVICES entry of each rank (rank r: the r-th visible GPU), refused in one
    line when fewer GPUs than ranks are visible."""
    from numba import cuda
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d for d in visible.split(",") if d.strip()] if visible else [str(r) for r in range(len(cuda.gpus))]
    if len(devices) < world:
        raise ValueError(f"parallel.tensor={world} device=cuda needs {world} GPUs (one a rank), "
                         f"{len(devices)} visible")
    return devices[:world]


def rank_collectives(comm: Communicator, unique_id: bytes | None) -> DeviceCollectives:
    """NCCL on this process's GPU (device 0 of its CUDA_VISIBLE_DEVICES) when a unique id was
    handed out, else the host-staged collectives over comm."""
    if unique_id is None:
        return StagedCollectives(comm)
    from numba import cuda
    all_gather(comm, np.ones((1, 1), np.int32))       # every rank loaded: NCCL's init waits without a timeout,
    cuda.select_device(0)                            # the host communicator's queues have one
    return NcclCollectives.create(comm.rank, comm.world_size, unique_id)


def cuda_rank_backend(cfg, tp, weights: WeightStream | None, comm: Communicator, unique_id: bytes | None):
    """The rank's TpCudaBackend: its shards' stream (None: random weights at the local shapes)."""
    from metrale.runtime.cuda_tp import TpCudaBackend
    return TpCudaBackend(tp, rank_collectives(comm, unique_id), weights, cfg=cfg, random_seed=int(cfg.seed))
