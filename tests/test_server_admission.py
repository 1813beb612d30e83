"""Admission work on the server's event loop: short prompts are encoded (and short conversations
rendered) on the loop itself, long ones on a worker thread, so a burst of short requests is not
held back by thread hops while a long prompt never stalls the loop."""
import asyncio
import threading

from metrale.server import app as server_app


def _where(size: int) -> str:
    async def main():
        return await server_app._inline_or_thread(size, lambda: threading.current_thread().name)
    return asyncio.run(main())


def test_short_input_runs_on_the_event_loop():
    assert _where(10) == threading.current_thread().name
    assert _where(server_app.INLINE_PREP_CHARS) == threading.current_thread().name


def test_long_input_runs_on_a_worker_thread():
    assert _where(server_app.INLINE_PREP_CHARS + 1) != threading.current_thread().name


def test_completion_burst_is_admitted_and_answered():
    """64 concurrent short completions through the HTTP app on the fake engine: every one
    answered with its own text, none lost, the engine holds no request after."""
    import httpx
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from fake_model import fake_engine
    from metrale.server import ServerThread, create_app
    engine = fake_engine(num_blocks=2048, block_size=4)
    app = create_app(engine)
    with ServerThread(app) as server:
        async def one(client, i):
            r = await client.post(server.url + "/v1/completions",
                                  json={"prompt": f"hello {i}", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
            return r.status_code, r.json()

        async def burst():
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(one(client, i) for i in range(64)))
        got = asyncio.run(burst())
    assert all(code == 200 for code, _ in got)
    assert all(body["usage"]["completion_tokens"] == 3 for _, body in got)
    assert not engine.requests
