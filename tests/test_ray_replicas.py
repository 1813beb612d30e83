"""Engine replicas on Ray Serve (metrale/server/replicas.py, issue 25 item 2).

The router and the no-Ray error are tested on their own; the Ray part runs as ONE test (one local
cluster: 2 CPUs, no dashboard, loopback, bounded waits), so pytest-xdist cannot split it over
workers that would each start a cluster; it skips when Ray Serve is not installed. First the Ray
Serve app (build_app: the ingress deployment and 2 engine deployments behind Serve's HTTP proxy on
a loopback port); then 2 replicas of the fake engine (tests/fake_model.py, 5 ms a step) behind the
app as `serve server.replicas=2` runs it (create_app around a ReplicaSet, uvicorn on a loopback
port): streamed completions and chat give the fake model's tokens and the same text as not
streamed, prompts sharing a prefix go to one replica, load spreads over both, killing a replica's
actor with 4 streams in flight over both ends each with its whole output or one error naming the
replica while the other replica serves, and once Ray Serve has restarted it requests to it succeed.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from functools import partial
from pathlib import Path

import httpx
import numpy as np
import pytest

from fake_model import FakeTokenizer, reference_continuation
from metrale.server.replicas import PrefixRouter

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ router
def test_router_sticks_to_the_replica_holding_the_prefix():
    r = PrefixRouter(2, block_tokens=4)
    a, _ = r.choose(list(range(1, 13)), [0, 0], [True, True])
    b, matched = r.choose(list(range(1, 13)) + [50, 51, 52, 53], [0, 0], [True, True])
    assert b == a and matched == 3
    c, matched = r.choose([9, 9, 9, 9, 9], [0, 0], [True, True])     # nothing shared: by load (round robin)
    assert matched == 0


def test_router_falls_back_to_the_least_loaded():
    r = PrefixRouter(2, block_tokens=4, imbalance=2)
    a, _ = r.choose(list(range(1, 9)), [0, 0], [True, True])
    other = 1 - a
    load = [0, 0]
    load[a] = 5                                                     # the holder is 5 ahead: too busy
    assert r.choose(list(range(1, 9)), load, [True, True]) == (other, 0)
    up = [True, True]
    up[other] = False                                               # the holder is down: the other one
    assert r.choose(list(range(1, 9)), [0, 0], up)[0] == a
    up[a] = False
    with pytest.raises(LookupError):
        r.choose([1, 2, 3], [0, 0], [False, False])
    # short prompts (under a block) and ties spread round robin
    picks = {r.choose([7], [0, 0], [True, True])[0] for _ in range(4)}
    assert picks == {0, 1}


def test_replicas_without_ray_say_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)             # `import ray` raises ImportError
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    from metrale.server.serve import main
    assert main(["server.replicas=2", "server.port=0"]) == 2
    err = capsys.readouterr().err
    assert "server.replicas needs Ray Serve" in err and "pip install 'metrale[ray]'" in err, err
    assert "Traceback" not in err


def test_tree_memory_counts_a_child_process():
    """bench/hostmem.py (bench/ray_replicas.py's peak memory): a child holding ~64 MB shows in the tree's peak."""
    import subprocess
    from bench.hostmem import TreeMemory, peak_rss_mb, tree
    code = "import sys; b = b'x' * (64 << 20); sys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdin.read()"
    with TreeMemory(period_s=0.02) as mem:
        alone = mem.peak_tree_mb
        child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert child.stdout.readline() == b"ready\n"
            assert child.pid in tree(os.getpid())
            mem.sample()
            assert peak_rss_mb(child.pid) > 60
        finally:
            child.communicate(timeout=10)
    assert mem.peak_tree_mb > alone + 60, mem.summary()


# --------------------------------------------------------------------------- the cluster
def _tokens(prompt: str, n: int) -> str:
    return "".join(f"<{t}>" for t in reference_continuation(FakeTokenizer().encode(prompt), n))


def _stream(client: httpx.Client, url: str, body: dict, on_chunk=None, timeout: float = 30.0) -> tuple[str, list]:
    """(the streamed text, the error events); asserts the stream ends with [DONE]."""
    text, errors, done = "", [], False
    with client.stream("POST", url, json={**body, "stream": True}, timeout=timeout) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                errors.append(event["error"])
                continue
            ch = event["choices"][0]
            text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
            if on_chunk is not None:
                on_chunk(text)
    assert done, "the stream did not end with [DONE]"
    return text, errors


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_replicas_on_a_local_ray_cluster():
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'metrale[ray]')")
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'metrale[ray]')")
    from ray import serve
    from bench.loadtest import fake_engine_for
    from metrale.server.app import create_app
    from metrale.server.replicas import ReplicaSet, build_app
    from metrale.server.serve import ServerThread
    from metrale.settings import compose

    t0 = time.monotonic()
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="WARNING",
             log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path, "OPENBLAS_NUM_THREADS": "1"}})
    rs = None
    settings = ["server.replicas=2", "server.engine_process=false", "server.replica_cpus=0.5",
                "server.served_model_name=fake"]
    build = partial(fake_engine_for, 1024, 5.0)
    try:
        # the documented Ray Serve app (build_app): Serve's own HTTP proxy on a loopback port
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(settings, build=build), name="metrale", route_prefix="/")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            text, errors = _stream(client, "/v1/completions", {"prompt": "through serve run", "max_tokens": 5,
                                                               "temperature": 0})
            assert (text, errors) == (_tokens("through serve run", 5), [])
            for tail in ("one", "two"):
                _stream(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "shared prefix " + tail}],
                                                         "max_tokens": 2})
            metrics = client.get("/metrics").text
            assert 'metrale_replica_prefix_routed_total{replica="0"} 1' in metrics or \
                'metrale_replica_prefix_routed_total{replica="1"} 1' in metrics, metrics
        # an engine deployment's own streaming method, for callers composing their own apps
        from metrale import SamplingParams
        engine0 = serve.get_deployment_handle("metrale-engine-0", app_name="metrale")
        items = list(engine0.options(stream=True).generate.remote("direct", [5, 6, 7, 8, 9],
                                                                  SamplingParams(max_tokens=4, temperature=0)))
        assert items[0] == ("added", 5) and items[-1][1][-1][3] == "length"
        assert b"".join(t[1] for _, ts in items[1:] for t in ts) == \
            np.array(reference_continuation([5, 6, 7, 8, 9], 4), np.int32).tobytes()
        serve.delete("metrale", _blocking=False)      # its CPUs (0.5 a replica) are not needed below
        app_s = time.monotonic() - t0

        # python -m metrale serve server.replicas=2: the ReplicaSet behind this process's uvicorn
        cfg = compose(settings)
        rs = ReplicaSet.start(cfg, build)
        started = time.monotonic() - t0
        with ServerThread(create_app(rs, cfg), grace_s=0.0) as srv, httpx.Client(base_url=srv.url) as client:
            loop = rs.loop
            # streaming completion and chat: the fake model's tokens
            text, errors = _stream(client, "/v1/completions", {"prompt": "hello replicas", "max_tokens": 6,
                                                               "temperature": 0})
            assert (text, errors) == (_tokens("hello replicas", 6), [])
            text, errors = _stream(client, "/v1/chat/completions",
                                   {"messages": [{"role": "user", "content": "a chat"}], "max_tokens": 5,
                                    "temperature": 0})
            assert (text, errors) == (_tokens("a chat", 5), [])
            # the same requests not streamed give the same text
            for url, body in (("/v1/completions", {"prompt": "hello replicas", "max_tokens": 6}),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a chat"}],
                                                        "max_tokens": 5})):
                streamed, errors = _stream(client, url, {**body, "temperature": 0})
                whole = client.post(url, json={**body, "temperature": 0}, timeout=30)
                assert whole.status_code == 200, whole.text
                choice = whole.json()["choices"][0]
                assert (choice.get("text") or choice["message"]["content"], errors) == (streamed, [])

            # a shared prefix (3 blocks of 4 tokens) goes to the replica that served it
            for prefix in ("The quick brown fox ", "Lorem ipsum dolor sit "):
                picks = []
                for tail in ("jumps", "sleeps", "runs away"):
                    _stream(client, "/v1/completions", {"prompt": prefix + tail, "max_tokens": 2})
                    picks.append(loop.recent[-1][1])
                assert len(set(picks)) == 1, picks

            # load spreads: 8 concurrent distinct prompts use both replicas
            before = [r.served for r in rs.replicas]
            results: list = [None] * 8

            def one(k: int) -> None:
                results[k] = _stream(client, "/v1/completions", {"prompt": f"{k} distinct prompt {k * 7}",
                                                                 "max_tokens": 20, "temperature": 0})
            threads = [threading.Thread(target=one, args=(k,)) for k in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert [r for r in results] == [(_tokens(f"{k} distinct prompt {k * 7}", 20), []) for k in range(8)]
            spread = [r.served - b for r, b in zip(rs.replicas, before)]
            assert min(spread) >= 2, spread
            metrics = client.get("/metrics").text
            assert 'metrale_replica_requests_total{replica="0"}' in metrics
            assert 'metrale_requests_total{finish_reason="length",replica="1"}' in metrics

            # kill a replica with 4 streams in flight over both: each ends with its whole output
            # or one error naming the killed replica, nothing hangs
            outs: list = [None] * 4
            going = [threading.Event() for _ in outs]
            ended = [0.0] * len(outs)
            long_prompts = [f"{k} long one" for k in range(4)]   # no shared block: spread by load

            def long_stream(k: int) -> None:
                outs[k] = _stream(client, "/v1/completions", {"prompt": long_prompts[k], "max_tokens": 200,
                                                              "temperature": 0},
                                  on_chunk=lambda text: going[k].set() if len(text) > 20 else None, timeout=60)
                ended[k] = time.monotonic()
            threads = [threading.Thread(target=long_stream, args=(k,)) for k in range(4)]
            for t in threads:
                t.start()
            assert all(e.wait(30) for e in going), "the long streams produced nothing"
            assert all(r.in_flight for r in rs.replicas), [r.in_flight for r in rs.replicas]
            victim = max(rs.replicas, key=lambda r: r.in_flight)
            lost = victim.in_flight
            killed_at = time.monotonic()
            ray.kill(ray.get_actor(victim.actor, namespace="serve"))
            for t in threads:
                t.join(45)
            assert not any(t.is_alive() for t in threads), "a stream did not end after the kill"
            ended_s = time.monotonic() - killed_at
            failed, lost_s = 0, 0.0
            for prompt, (text, errors), end in zip(long_prompts, outs, ended):
                whole = _tokens(prompt, 200)
                if errors:
                    failed += 1
                    lost_s = max(lost_s, end - killed_at)
                    assert len(errors) == 1 and f"engine replica {victim.index} died" in errors[0]["message"], errors
                    assert errors[0]["type"] == "server_error" and whole.startswith(text)
                else:
                    assert text == whole
            assert 1 <= failed <= lost, (failed, lost)         # one may have finished just before the kill
            # meanwhile the other replica serves
            for k in range(3):
                text, errors = _stream(client, "/v1/completions", {"prompt": f"during restart {k}", "max_tokens": 3,
                                                                   "temperature": 0})
                assert (text, errors) == (_tokens(f"during restart {k}", 3), [])
            # Ray Serve restarts it; then requests reach it again
            _wait(lambda: victim.up and victim.restarts >= 1, 60, f"replica {victim.index} to come back")
            restarted_s = time.monotonic() - killed_at
            served = victim.served
            for k in range(4):
                text, errors = _stream(client, "/v1/completions", {"prompt": f"{k} after restart", "max_tokens": 3,
                                                                   "temperature": 0})
                assert (text, errors) == (_tokens(f"{k} after restart", 3), [])
            assert victim.served > served
            assert client.get("/health").status_code == 200
            print(f"\n[ray replicas] serve-run app checked at {app_s:.1f} s; 2 more replicas up at {started:.1f} s; "
                  f"{failed} streams lost, ended {lost_s:.2f} s after the kill (all 4: {ended_s:.2f} s); "
                  f"replica back in {restarted_s:.1f} s; total {time.monotonic() - t0:.1f} s",
                  file=sys.stderr)
    finally:
        if rs is not None:
            rs.close()
        serve.shutdown()
        ray.shutdown()
