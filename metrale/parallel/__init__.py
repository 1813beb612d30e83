"""Expert parallelism: experts split across ranks, token rows moved by all-to-all (ep.py) through
a Communicator (comm.py: the protocol, a thread-based fake for CPU tests; nccl.py: nccl4py), and
rank 0's step plan broadcast to the followers (plan.py, runner.py). docs/deepseek.md has the flow."""
from metrale.parallel.comm import Communicator, FakeCommunicator, FakeWorld, broadcast, gather, run_ranks
from metrale.parallel.ep import ExpertParallel, combine_slots
from metrale.parallel.nccl import Nccl4pyCommunicator
from metrale.parallel.plan import Command, StepPlan, decode_plan, encode_plan
from metrale.parallel.runner import EPRank, ep_generate

__all__ = ["Communicator", "FakeCommunicator", "FakeWorld", "broadcast", "gather", "run_ranks",
           "ExpertParallel", "combine_slots", "Nccl4pyCommunicator", "Command", "StepPlan", "decode_plan", "encode_plan",
           "EPRank", "ep_generate"]
