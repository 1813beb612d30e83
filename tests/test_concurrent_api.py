"""A concurrent library API: any number of stream() / astream() / generate() callers on one Engine
(threads or asyncio) each get exactly their tokens, astream never blocks the event loop, and once
the last caller leaves the engine steps inline again."""
import asyncio
import threading
import time

from fake_model import fake_engine, reference_continuation
from metrale import SamplingParams


def _slow(engine, seconds=0.003):
    forward = engine.backend.forward
    engine.backend.forward = lambda batch: (time.sleep(seconds), forward(batch))[1]
    return engine


def _tokens(deltas):
    return [int(t) for d in deltas for t in d.token_ids]


def test_threads_streaming_at_once_each_get_their_tokens():
    engine = _slow(fake_engine(num_blocks=256))
    prompts = [[i + 1, i + 2, i + 3] for i in range(6)]
    got = {}

    def run(i):
        got[i] = _tokens(engine.stream(prompts[i], SamplingParams(max_tokens=10 + i, temperature=0.0, ignore_eos=True)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, p in enumerate(prompts):
        assert got[i] == reference_continuation(p, 10 + i), i
    assert engine._driver is None or not engine._driver.alive        # the last one ended the thread
    inline = engine.generate([[1, 2]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert inline.token_ids.tolist() == reference_continuation([1, 2], 3)    # stepped inline again
    engine.blocks.check_no_leaks([])


def test_astreams_share_the_loop_and_never_block_it():
    engine = _slow(fake_engine(num_blocks=256), 0.05)
    ticks = []

    async def ticker(stop):
        while not stop.is_set():
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.002)

    async def one(p, n):
        return _tokens([d async for d in engine.astream(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))])

    async def main():
        stop = asyncio.Event()
        t = asyncio.create_task(ticker(stop))
        outs = await asyncio.gather(one([5, 6], 12), one([7, 8, 9], 9), one([4], 15))
        stop.set()
        await t
        return outs

    outs = asyncio.run(main())
    assert outs == [reference_continuation([5, 6], 12), reference_continuation([7, 8, 9], 9),
                    reference_continuation([4], 15)]
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    # a forward takes 50 ms and there are 15 steps: a loop that waited for them would show ~15 gaps of
    # 50 ms; one scheduling hiccup of a loaded CI machine is not that
    assert sum(g > 0.045 for g in gaps) <= 1, sorted(gaps)[-4:]
    assert sorted(gaps)[len(gaps) // 2] < 0.01


def test_generate_beside_a_stream_and_an_early_stop():
    engine = _slow(fake_engine(num_blocks=256))
    stream = engine.stream([3, 4, 5], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    first = next(stream)
    outs = engine.generate([[1, 2], [9]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [o.token_ids.tolist() for o in outs] == [reference_continuation([1, 2], 6), reference_continuation([9], 6)]
    stream.close()                                # stops early: its request is aborted, blocks freed
    assert len(first.token_ids) >= 1
    assert not engine.has_unfinished()
    engine.blocks.check_no_leaks([])
