"""Running the app: `python -m metrale serve [key=value ...]` (also the `metrale-serve` script).

Examples:
  python -m metrale serve
  python -m metrale serve model=/path/to/model.gguf server.port=8080 server.api_key=sk-local
  python -m metrale serve server.host=0.0.0.0 scheduler.max_num_seqs=64 --cfg job
Settings: every setting of `python -m metrale` plus server.* (host, port, api_key, api_key_file,
served_model_name, max_body_bytes, max_json_depth, read_timeout_s, allow_client_chat_template,
shutdown_grace_s, parse_reasoning, access_log, engine_process); see docs/server.md. The API key can
also come from the METRALE_API_KEY environment variable.

The engine runs in a process of its own (server.engine_process=true, the default): the HTTP
server and the engine loop do not share a GIL. server.engine_process=false keeps it in this
process (a thread), as create_app(engine) does for callers embedding the app.

Shutdown (SIGINT/SIGTERM): the listening socket closes, in-flight requests get
server.shutdown_grace_s seconds to finish, the rest end with finish_reason "abort", the engine
process is stopped, then exit.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time

from typing import TYPE_CHECKING

import uvicorn

from metrale.driver import EngineLoop

if TYPE_CHECKING:
    from metrale.server.engine_process import ProcessLoop

USAGE = __doc__


class MetraleServer(uvicorn.Server):
    """uvicorn.Server that drains the engine loop (or stops the engine process) before it waits for
    connections to close."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop | ProcessLoop, grace_s: float):
        super().__init__(config)
        self.engine_loop, self.grace_s = engine_loop, grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in getattr(self, "servers", []):     # stop accepting first
            server.close()
        for sock in sockets or []:
            sock.close()
        # in-flight requests get the grace period (a second Ctrl-C cuts it short), then abort
        await self.engine_loop.drain(self.grace_s, cut_short=lambda: self.force_exit)
        await super().shutdown(sockets)
        # uvicorn re-raises the signal it caught once it is done; the shutdown was clean, exit 0
        getattr(self, "_captured_signals", []).clear()


def http_protocol(header_timeout_s: float):
    """uvicorn's HTTP protocol class (httptools when installed, else h11) closing a connection
    whose first request's headers have not arrived within header_timeout_s: uvicorn itself times
    out only idle keep-alive connections, so a client that never finishes its headers (or never
    sends any) would hold a connection forever."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:  # pragma: no cover - httptools is a dependency
        from uvicorn.protocols.http.h11_impl import H11Protocol as base

    class HeaderTimeoutProtocol(base):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._header_timer = self.loop.call_later(header_timeout_s, self._close_if_no_request)

        def _close_if_no_request(self):
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc):
            self._header_timer.cancel()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


class ServerThread:
    """The app under uvicorn in a background thread on a loopback port (tests, benchmarks).

        with ServerThread(create_app(engine)) as srv:
            OpenAI(base_url=srv.url + "/v1", api_key="none")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, grace_s: float | None = None,
                 loop: str = "auto"):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        server = app.state.server
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                timeout_graceful_shutdown=5, loop=loop,
                                http=http_protocol(server.scfg.header_timeout_s))
        grace = server.scfg.shutdown_grace_s if grace_s is None else grace_s
        self.server = MetraleServer(config, app.state.engine_loop, grace)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="metrale-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None, build=None) -> int:
    """build(cfg) -> Engine makes the engine (default Engine(cfg=cfg)); with server.engine_process
    it runs in the engine process, so it must be a picklable top-level function (bench/serve_profile.py)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    from metrale.__main__ import config_from_argv
    cfg, code = config_from_argv(argv)
    if cfg is None:
        return code
    s = cfg.server
    if not 0 <= s.port <= 65535:
        return _fail(f"bad setting: server.port must be in [0, 65535], got {s.port}")
    if s.max_body_bytes < 1 or s.shutdown_grace_s < 0:
        return _fail("bad setting: server.max_body_bytes must be >= 1 and server.shutdown_grace_s >= 0")
    try:
        cfg.server.api_key = api_key(s.api_key, s.api_key_file, os.environ.get("METRALE_API_KEY"))
    except OSError as exc:
        return _fail(f"bad setting: server.api_key_file: {exc}")
    level = str(cfg.log_level).upper()
    logging.basicConfig(level=getattr(logging, level, logging.WARNING),
                        format="%(levelname)s %(name)s: %(message)s")
    if s.replicas:                      # engine replicas on Ray Serve (replicas.py)
        from metrale.server.replicas import serve_replicas
        return serve_replicas(cfg, build)
    from metrale.models.registry import ModelNotFoundError
    from metrale.server.app import create_app
    from metrale.server.engine_process import EngineProcess, EngineStartError, build_engine
    build = build or build_engine
    try:
        engine = EngineProcess.start(cfg, build) if s.engine_process else build(cfg)
    except (EngineStartError, ModelNotFoundError, ValueError, RuntimeError) as exc:
        return _fail(str(exc))
    try:
        app = create_app(engine, cfg)
        info = engine.info if s.engine_process else None
        where = f", engine process {info.pid}" if info else ""
        print(f"[metrale] serving {app.state.server.model_name} ({engine.model_config.name} on "
              f"{info.backend if info else engine.backend.name}, loaded in "
              f"{info.load_seconds if info else engine.load_seconds:.2f} s{where}) at http://{s.host}:{s.port}/v1"
              f"{' (API key required)' if s.api_key else ''}", file=sys.stderr)
        config = uvicorn.Config(app, host=s.host, port=s.port, log_level=_uvicorn_level(level),
                                access_log=s.access_log, lifespan="on", timeout_graceful_shutdown=5,
                                http=http_protocol(s.header_timeout_s))
        MetraleServer(config, app.state.engine_loop, s.shutdown_grace_s).run()
    finally:
        if s.engine_process:
            engine.close()                 # stopped by the drain already; this is for a failed start
    return 0


def api_key(given: str | None, path: str | None, env: str | None) -> str | None:
    """The API key: server.api_key, else the first line of server.api_key_file, else the
    METRALE_API_KEY environment variable (the last two keep it out of the process list)."""
    if given:
        return given
    if path:
        with open(path, encoding="utf-8") as f:
            key = f.readline().strip()
        if not key:
            raise OSError(f"{path} holds no key")
        return key
    return env or None


def _uvicorn_level(level: str) -> str:
    level = level.lower()
    return level if level in uvicorn.config.LOG_LEVELS else "warning"


def _fail(message: str) -> int:
    print(f"metrale serve: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
