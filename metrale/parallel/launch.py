"""One process per rank, supervised: launch(world, target, args) spawns `world` processes
(multiprocessing "spawn": fresh interpreters, the parent's environment and sys.path), each
exec'd with CUDA_VISIBLE_DEVICES = its GPU (pin_devices: rank r gets the r-th of the parent's
CUDA_VISIBLE_DEVICES, or GPU r), so nothing it imports can start CUDA on another GPU and every
rank sees its GPU as device 0. Rank 0 calls make_id() (an NCCL unique id: bytes) and hands it to each
other rank through its own pipe; then every rank runs target(rank, world, uid, report, *args).

report(phase, **data) sends a message to the parent at once ({"rank", "phase", "time", **data});
the parent passes each to on_message as it arrives, so partial results are seen even if a later
phase hangs. A rank ends with a "done" message, or "error" with its traceback; it then leaves
with os._exit (no atexit handlers, no NCCL teardown that could wait for a dead peer).

Nothing hangs for ever: the parent stops waiting `grace` seconds after the first error or death
of a rank, when a rank has said nothing `first` seconds after the start, when no rank has said
anything for `stall` seconds, or after `timeout` seconds, and kills what is left. A follower waits at most `handoff_timeout` seconds for the id.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Report:
    """The ranks' messages in arrival order; `problems` says why the run ended early (empty when
    every rank said "done")."""
    messages: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def of(self, phase: str) -> dict[int, dict]:
        """The last message of `phase` from each rank that sent one."""
        return {m["rank"]: m for m in self.messages if m["phase"] == phase}


def _child(rank: int, world: int, target: Callable, args: tuple, make_id: Callable | None, conns: list,
           box, device: str | None, handoff_timeout: float) -> None:
    if device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = device         # (already so since the exec; kept explicit)

    def report(phase: str, **data) -> None:
        box.put({"rank": rank, "phase": phase, "time": time.time(), **data})

    code = 0
    try:
        uid = None
        if make_id is not None:
            if rank == 0:
                uid = make_id()
                for c in conns:
                    c.send(uid)
            else:
                if not conns[0].poll(handoff_timeout):
                    raise TimeoutError(f"no unique id from rank 0 within {handoff_timeout:.0f} s")
                uid = conns[0].recv()         # EOFError when rank 0 died first
        target(rank, world, uid, report, *args)
        report("done")
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        code = 1
        try:
            report("error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        box.close()
        box.join_thread()                     # the messages are in the pipe before we leave
        os._exit(code)


def launch(world: int, target: Callable, args: tuple = (), *, make_id: Callable[[], bytes] | None = None,
           pin_devices: bool = True, timeout: float = 600.0, stall: float = 300.0, grace: float = 10.0,
           first: float | None = None, handoff_timeout: float = 120.0,
           on_message: Callable[[dict], None] | None = None) -> Report:
    """Run target on `world` spawned ranks and supervise them (see the module docstring);
    `first`: seconds for every rank to send its first message (default `stall`).
    target and args must be picklable (a module-level function; queues made with
    multiprocessing.get_context("spawn"))."""
    ctx = mp.get_context("spawn")
    box = ctx.Queue()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world - 1)]    # (follower's end, rank 0's end)
    procs = []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(r) for r in range(world)]
    if pin_devices and len(devices) < world:
        raise ValueError(f"{world} ranks but CUDA_VISIBLE_DEVICES={visible}")
    try:
        for r in range(world):
            conns = [w for _, w in pipes] if r == 0 else [pipes[r - 1][0]]
            if pin_devices:         # the child is exec'd with this environment: set before any import
                os.environ["CUDA_VISIBLE_DEVICES"] = devices[r]
            p = ctx.Process(target=_child, name=f"rank{r}", daemon=True,
                            args=(r, world, target, args, make_id, conns, box, devices[r] if pin_devices else None,
                                  handoff_timeout))
            p.start()
            procs.append(p)
    finally:
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
    for a, b in pipes:          # the children hold their ends: a dead rank 0 closes its pipes
        a.close()
        b.close()
    report = Report()
    start = last = time.time()
    finished: set[int] = set()
    failed_at: float | None = None
    gone_at: dict[int, float] = {}
    heard: set[int] = set()

    def take(m: dict) -> None:
        nonlocal last, failed_at
        report.messages.append(m)
        heard.add(m["rank"])
        last = time.time()
        if m["phase"] in ("done", "error"):
            finished.add(m["rank"])
        if m["phase"] == "error":
            report.problems.append(f"rank {m['rank']} failed: {m.get('error')}")
            failed_at = failed_at or last
        if on_message is not None:
            try:
                on_message(m)
            except Exception:  # noqa: BLE001 - a printing bug must not stop the supervision
                traceback.print_exc()

    while len(finished) < world:
        try:
            take(box.get(timeout=0.5))
        except queue.Empty:
            pass
        except Exception as e:  # noqa: BLE001 - a message cut by a dying rank
            report.problems.append(f"unreadable message from a rank: {e!r}")
        now = time.time()
        for r, p in enumerate(procs):
            if r not in finished and not p.is_alive():
                if now - gone_at.setdefault(r, now) > 3.0:        # its last messages had time to arrive
                    report.problems.append(f"rank {r} exited with code {p.exitcode} without reporting")
                    finished.add(r)
                    failed_at = failed_at or now
        waiting = [r for r in range(world) if r not in finished]
        if failed_at is not None and waiting and now - failed_at > grace:
            report.problems.append(f"ranks {waiting} still running {grace:.0f} s after a failure: killed")
            break
        quiet = [r for r in waiting if r not in heard]
        if quiet and now - start > (stall if first is None else first):
            report.problems.append(f"ranks {quiet} said nothing in {now - start:.0f} s (hung at the start?): "
                                   f"ranks {waiting} killed")
            break
        if waiting and now - last > stall:
            report.problems.append(f"no message from any rank for {stall:.0f} s (hung?): ranks {waiting} killed")
            break
        if waiting and now - start > timeout:
            report.problems.append(f"out of time ({timeout:.0f} s): ranks {waiting} killed")
            break
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5)
    while True:                 # what arrived while we stopped
        try:
            take(box.get(timeout=0.2))
        except Exception:  # noqa: BLE001 - empty, or cut by a killed rank
            break
    return report
