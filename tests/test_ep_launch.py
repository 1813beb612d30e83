"""metrale.parallel.launch on CPU (spawned processes, no GPU): the id handoff, CUDA_VISIBLE_DEVICES
per rank, messages as they come, and no hang when a rank fails, dies or goes silent;
QueueCommunicator (ranks as processes); bench/ep_bench.py's whole flow as a --dry-run."""
import json
import os
import queue
import threading
import time

import numpy as np
import pytest

from metrale.parallel import QueueCommunicator, broadcast, gather, launch


def _make_id() -> bytes:
    return b"uid-" + str(os.getpid()).encode()


def _echo(rank, world, uid, report, tag):
    report("hello", uid=uid, tag=tag, visible=os.environ.get("CUDA_VISIBLE_DEVICES"), pid=os.getpid())


def _one_fails(rank, world, uid, report, how):
    report("ready")
    if rank == 1:
        if how == "raise":
            raise ValueError("boom on rank 1")
        os._exit(3)
    time.sleep(120)                         # as a rank stuck in a collective with the dead one


def _silent(rank, world, uid, report):
    report("ready")
    time.sleep(120)


def _one_silent(rank, world, uid, report):
    while rank == 0:
        report("still here")
        time.sleep(0.5)
    time.sleep(120)


def _bad_id() -> bytes:
    raise RuntimeError("no NCCL here")


def test_launch_hands_the_id_and_pins_a_device_per_rank(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    seen = []
    report = launch(2, _echo, ("x",), make_id=_make_id, timeout=60, on_message=seen.append)
    assert report.ok, report.problems
    hello = report.of("hello")
    assert {r: m["visible"] for r, m in hello.items()} == {0: "5", 1: "7"}
    assert hello[0]["uid"] == hello[1]["uid"] == b"uid-" + str(hello[0]["pid"]).encode()   # made on rank 0
    assert hello[0]["tag"] == "x" and set(report.of("done")) == {0, 1}
    assert [m["phase"] for m in seen] == [m["phase"] for m in report.messages]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,7"                                     # the parent's, back


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_failing_or_dying_rank_ends_the_run_quickly(how):
    t0 = time.time()
    report = launch(2, _one_fails, (how,), pin_devices=False, timeout=60, grace=2)
    assert time.time() - t0 < 30
    assert not report.ok
    text = "\n".join(report.problems)
    if how == "raise":
        err = report.of("error")[1]
        assert "ValueError: boom on rank 1" in err["error"] and "_one_fails" in err["traceback"]
    else:
        assert "rank 1 exited with code 3 without reporting" in text
    assert "[0]" in text and "killed" in text                  # rank 0 was stuck: killed


def test_a_silent_run_is_stopped():
    report = launch(2, _silent, pin_devices=False, timeout=60, stall=2, first=30)
    assert not report.ok and "no message from any rank for 2 s" in report.problems[0]


def test_a_rank_silent_from_the_start_is_caught():
    report = launch(2, _one_silent, pin_devices=False, timeout=60, stall=30, first=10)
    assert not report.ok and "ranks [1] said nothing in" in report.problems[0]


def test_no_unique_id_fails_every_rank_fast():
    t0 = time.time()
    report = launch(2, _echo, ("x",), make_id=_bad_id, pin_devices=False, timeout=60, grace=5)
    assert time.time() - t0 < 30
    errors = report.of("error")
    assert "no NCCL here" in errors[0]["error"]
    assert 1 in errors and "EOFError" in errors[1]["error"]   # rank 0's pipe closed: no wait for the timeout


def test_queue_communicator_out_of_order_arrivals():
    """Threads stand in for processes (the boxes are only queues); ranks race ahead, so pieces
    of a later collective arrive before an earlier one's."""
    world = 3
    boxes = [queue.Queue() for _ in range(world)]
    out = [None] * world

    def body(rank):
        comm = QueueCommunicator(rank, boxes, timeout=10)
        if rank == 2:
            time.sleep(0.2)
        got = []
        for step in range(4):
            send = np.array([[100 * step + 10 * rank + d] for d in range(world) for _ in range(d + 1)], np.int64)
            recv, counts = comm.all_to_all_v(send, [d + 1 for d in range(world)])
            got.append((recv[:, 0].tolist(), counts.tolist()))
        b = broadcast(comm, np.arange(4) if rank == 0 else None)
        g = gather(comm, np.full((rank, 1), rank))
        out[rank] = (got, b.tolist(), None if g is None else [x.shape[0] for x in g])

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for r in range(world):
        got, b, g = out[r]
        assert got == [([100 * s + 10 * src + r for src in range(world) for _ in range(r + 1)], [r + 1] * world)
                       for s in range(4)]
        assert b == [0, 1, 2, 3]
    assert out[0][2] == [0, 1, 2] and out[1][2] is None


def test_queue_communicator_times_out_on_a_missing_peer():
    comm = QueueCommunicator(0, [queue.Queue(), queue.Queue()], timeout=0.2)
    with pytest.raises(RuntimeError, match="no rows from rank 1"):
        comm.all_to_all_v(np.zeros((2, 1)), [1, 1])


def _send_and_exit(boxes, rows: int) -> None:
    """Rank 1 of a 2-rank broadcast that leaves with os._exit right after its last send, as
    metrale.parallel.launch's children do."""
    comm = QueueCommunicator(1, boxes, timeout=30)
    comm.all_to_all_v(np.ones((rows, 1024), np.float32), [rows, 0])
    comm.finish()
    os._exit(0)


def test_last_collective_survives_the_exit_after_finish():
    """A rank's last pieces are written by its queue's feeder thread after all_to_all_v returns:
    os._exit right after would drop them (a tensor-parallel run's STOP was lost that way).
    finish() returns once they have left: all 32 MB arrive."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    boxes = [ctx.Queue() for _ in range(2)]
    child = ctx.Process(target=_send_and_exit, args=(boxes, 8192))    # 32 MB: a long write
    child.start()
    try:
        recv, counts = QueueCommunicator(0, boxes, timeout=30).all_to_all_v(np.zeros((0, 1024), np.float32), [0, 0])
    finally:
        child.join(10)
    assert counts.tolist() == [0, 8192] and recv.shape == (8192, 1024) and (recv == 1).all()


def test_ep_bench_dry_run(tmp_path):
    """The two-GPU script's own code on CPU: spawned ranks, the phases and their messages, the
    EP == alone check, records and the raw log."""
    from bench import ep_bench
    rec, raw = tmp_path / "ep.json", tmp_path / "raw.json"
    rc = ep_bench.main(["--dry-run", "--batches", "1,4", "--steps", "2", "--ctx", "32", "--timeout", "120",
                        "--out", str(rec), "--raw", str(raw)])
    assert rc == 0
    records = json.loads(rec.read_text())
    assert [r["figure"] for r in records] == ["moe decode tok/s, EP=2, batch 1", "moe decode tok/s, EP=2, batch 4"]
    assert all(r["value"] > 0 and r["peer"] > 0 and r["extra"]["ep_equals_single_gpu"] for r in records)
    phases = [(m["rank"], m["phase"]) for m in json.loads(raw.read_text())]
    for r in (0, 1):
        assert (r, "ready") in phases and (r, "tokens") in phases and (r, "closed") in phases and (r, "done") in phases
    assert phases.count((0, "ep_rate")) == 2 and phases.count((0, "single_rate")) == 2


def test_a_hung_teardown_is_reported_not_waited_for():
    from bench.ep_bench import _teardown
    t0 = time.time()
    assert _teardown(lambda: time.sleep(60), 0.3) == {"ok": False, "hung": 0.3}
    assert time.time() - t0 < 5
    assert _teardown(lambda: None, 5) == {"ok": True}
    assert _teardown(lambda: 1 / 0, 5)["error"].startswith("ZeroDivisionError")
