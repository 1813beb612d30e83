"""A tensor-parallel follower between steps (metrale/parallel/tp.py, TPRank.follow): it waits for
rank 0's next plan for as long as the leader's Engine has no request, not the host communicator's
per-collective timeout (QueueCommunicator, 120 s by default): an idle `serve` or notebook Engine
used to lose its followers after two minutes, and with them the next step."""
import multiprocessing as mp
import threading
import time

from metrale.parallel.comm import QueueCommunicator
from metrale.parallel.tp import TPRank


def test_followers_outwait_the_collective_timeout_between_steps():
    world, timeout, idle = 3, 0.3, 1.2
    ctx = mp.get_context("spawn")
    boxes = [ctx.Queue() for _ in range(world)]
    results, errors = {}, {}

    def follower(rank):
        try:
            results[rank] = TPRank(QueueCommunicator(rank, boxes, timeout=timeout), backend=None).follow()
        except Exception as e:  # noqa: BLE001 - checked below
            errors[rank] = e

    threads = [threading.Thread(target=follower, args=(r,), daemon=True) for r in range(1, world)]
    for t in threads:
        t.start()
    time.sleep(idle)                        # the leader has nothing to run: longer than the timeout
    TPRank(QueueCommunicator(0, boxes, timeout=timeout), backend=None).stop()
    for t in threads:
        t.join(10)
    assert not errors, errors
    assert results == {1: 0, 2: 0}          # both got STOP (rank 2's early piece to rank 1 did not end the wait)


def test_a_follower_whose_leader_is_gone_stops_waiting():
    boxes = [mp.get_context("spawn").Queue() for _ in range(2)]
    comm = QueueCommunicator(1, boxes, timeout=0.2)
    alive = iter([True, True, False])
    try:
        comm.wait_for(0, alive=lambda: next(alive), poll=0.05)
    except RuntimeError as e:
        assert "rank 0 is gone (waiting for collective #0)" in str(e)
    else:
        raise AssertionError("wait_for returned without rank 0's piece")
