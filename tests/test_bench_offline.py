"""The offline benchmark's KV+weight bandwidth bound (bench/run_all.py) on hand-made step logs,
the Engine's step log, and the performance.md table it regenerates."""
import pytest

from bench import run_all
from bench.peers import kv_bytes_per_token, load_shape, weight_bytes


def test_bound_of_a_hand_made_step_log():
    # two forwards: a prefill of 10 tokens (context 10) and a decode of 2 rows (contexts 11 and 5)
    log = [(10, 10), (2, 16)]
    b = run_all.bandwidth_bound(log, weight_bytes=1000, kv_bytes_per_token=10, copy_bytes_s=100.0,
                                generated_tokens=4)
    assert b["forwards"] == 2 and b["batch_tokens"] == 12 and b["kv_tokens_read"] == 26
    assert b["weight_bytes_read"] == 2000 and b["kv_bytes_read"] == 260 and b["bytes_read"] == 2260
    assert b["bound_s"] == pytest.approx(22.6)
    assert b["bound_tok_s"] == pytest.approx(4 / 22.6)


def test_roofline_takes_the_larger_of_bytes_and_compute_per_forward():
    log = [(10, 10), (2, 16)]
    b = run_all.bandwidth_bound(log, 1000, 10, 100.0, 4, flops_per_token=1000.0, peak_flops=500.0)
    # forward 1: bytes 1100/100 = 11 s, compute 10*1000/500 = 20 s; forward 2: 11.6 s vs 4 s
    assert b["roofline_s"] == pytest.approx(20 + 11.6)
    assert b["roofline_tok_s"] == pytest.approx(4 / 31.6)


def test_bound_without_a_bandwidth_is_pending():
    b = run_all.bandwidth_bound([(1, 5)], 10, 1, None, 1)
    assert b["bound_s"] is None and b["bound_tok_s"] is None and b["bytes_read"] == 15


def test_analytic_bound():
    # one request: prompt 3, output 2 -> reads contexts 3 and 4; weights read twice
    assert run_all.analytic_bound([(3, 2)], 100, 10, 10.0) == pytest.approx(2 / ((2 * 100 + 70) / 10.0))


def test_shape_bytes():
    s = load_shape("smollm2-135m-shape")
    assert kv_bytes_per_token(s) == 2 * 2 * 30 * 3 * 64
    assert 250e6 < weight_bytes(s) < 300e6          # ~135 M bf16 parameters (tied LM head counted once)


def test_engine_step_log_records_tokens_and_context():
    from fake_model import fake_engine
    from metrale import SamplingParams
    eng = fake_engine()
    eng.step_log = []
    eng.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
    # prefill of 5 tokens (context 5), then decodes of 1 token at contexts 6 and 7
    assert eng.step_log == [(5, 5), (1, 6), (1, 7)]
    eng.step_log = None                              # off by default: nothing recorded
    eng.generate([[1, 2]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)


def test_offline_records_and_table(tmp_path):
    off = {"smollm2-135m-shape": {"requests": 2, "output_tokens": 4, "seconds": 2.0, "tok_s": 2.0, "steps": 2,
                                  "step_log": [[10, 10], [2, 16]], "request_lengths": [[5, 2], [5, 2]],
                                  "poisson": {"rate_per_s": 16.0, "ttft_ms": {"p50": 1.0}, "itl_ms": {"p50": 2.0}}}}
    peer = {"hf_offline:smollm2-135m-shape:32": {"tok_s": 1.0}}
    recs = run_all.offline_records(off, peer, 4.25e12, "test")
    rec = recs[0]
    assert rec["benchmark"] == "offline" and rec["peer"] == 1.0 and rec["ratio_to_peer"] == pytest.approx(2.0)
    assert rec["limit"] == pytest.approx(rec["extra"]["bound_tok_s"])
    assert rec["ratio_to_limit"] == pytest.approx(2.0 / rec["limit"])
    assert [r["figure"] for r in recs[1:]] == ["smollm2-135m-shape Poisson 16/s ttft p50",
                                               "smollm2-135m-shape Poisson 16/s itl p50"]
    table = run_all.render_offline_table(recs)
    assert "| SmolLM2-135M | 2 tok/s (4 tokens, 2.0 s) |" in table
    assert "| Llama-3.2-1B | pending |" in table
    md = tmp_path / "performance.md"
    md.write_text(f"# P\n\ntext\n{run_all.OFFLINE_BEGIN}\nold\n{run_all.OFFLINE_END}\n\nafter\n")
    assert run_all.update_performance_md(md, table)
    text = md.read_text()
    assert "old" not in text and table in text and text.endswith("after\n") and text.startswith("# P\n\ntext\n")
