"""Expert parallelism: experts split across ranks, token rows moved by all-to-all (ep.py) through
a Communicator (comm.py: the protocol and CPU fakes, threads or processes; nccl.py: nccl4py),
rank 0's step plan broadcast to the followers (plan.py, runner.py), one supervised process per
GPU (launch.py); collectives.py: all-reduce / all-gather on device buffers (tensor parallelism on
CUDA). docs/deepseek.md and docs/parallel.md have the flows."""
from metrale.parallel.comm import (Communicator, FakeCommunicator, FakeWorld, QueueCommunicator, broadcast, gather,
                                   run_ranks)
from metrale.parallel.collectives import DeviceCollectives, NcclCollectives, StagedCollectives
from metrale.parallel.ep import ExpertParallel, combine_slots
from metrale.parallel.launch import Report, launch
from metrale.parallel.nccl import Nccl4pyCommunicator, nccl_info, nccl_unique_id
from metrale.parallel.plan import Command, StepPlan, decode_plan, encode_plan
from metrale.parallel.ep_rank import EPRank, ep_generate

__all__ = ["Communicator", "FakeCommunicator", "FakeWorld", "QueueCommunicator", "broadcast", "gather", "run_ranks",
           "DeviceCollectives", "NcclCollectives", "StagedCollectives", "ExpertParallel", "combine_slots", "Report", "launch", "Nccl4pyCommunicator", "nccl_info", "nccl_unique_id",
           "Command", "StepPlan", "decode_plan", "encode_plan", "EPRank", "ep_generate"]
