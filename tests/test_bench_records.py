"""bench.records: make, write, load, render and plot benchmark records (CPU only)."""
import importlib.util
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import records as R  # noqa: E402


def _decode(value=5000.0, peer=5445.8):
    return R.make_record("decode", "llama-3-8b b32", value, "tok/s", 7890.0, peer,
                         "torch.compile", "NVIDIA H200", "python -m bench.peers", {"batch": 32})


def test_make_record_fields_and_ratios():
    r = _decode()
    assert tuple(r) == R.KEYS
    assert r["ratio_to_limit"] == pytest.approx(5000 / 7890)
    assert r["ratio_to_peer"] == pytest.approx(5000 / 5445.8)
    assert r["extra"] == {"batch": 32} and r["date"][:2] == "20" and "T" in r["date"]
    json.dumps(r)


def test_times_invert_ratios_and_missing_peer():
    r = R.make_record("latency", "ttft", 20.0, "ms", 10.0, 40.0, "hf", "H200", "cmd")
    assert r["ratio_to_limit"] == pytest.approx(0.5) and r["ratio_to_peer"] == pytest.approx(2.0)
    r = R.make_record("copy", "d2d", 4.2, "TB/s", None, None, None, "H200", "cmd")
    assert r["ratio_to_limit"] is None and r["ratio_to_peer"] is None and r["extra"] == {}


def test_write_one_file_per_benchmark_and_load(tmp_path):
    recs = [_decode(), _decode(6000.0),
            R.make_record("prefill", "8b 4096", 622.0, "TFLOP/s", 732.0, None, None, "H200", "c")]
    paths = R.write_records(recs, str(tmp_path / "bench"))
    assert sorted(os.path.basename(p) for p in paths) == ["decode.json", "prefill.json"]
    assert len(json.load(open(tmp_path / "bench" / "decode.json"))) == 2
    back = R.load_records(str(tmp_path / "bench"))
    assert back == recs[:2] + recs[2:]
    assert R.load_records(str(tmp_path / "missing")) == []


def test_write_single_file_and_merge(tmp_path):
    f = str(tmp_path / "d.json")
    R.write_records([_decode(1.0)], f)
    other = R.make_record("decode", "smollm2 b1", 900.0, "tok/s", None, 940.7, "torch.compile",
                          "H200", "c")
    R.write_records([_decode(2.0), other], f, merge=True)
    R.write_records([_decode(3.0)], f, merge=True)
    got = {r["figure"]: r["value"] for r in R.load_records(f)}
    assert got == {"smollm2 b1": 900.0, "llama-3-8b b32": 3.0}
    R.write_records([_decode(4.0)], f)
    assert [r["value"] for r in R.load_records(f)] == [4.0]
    with pytest.raises(ValueError):
        R.write_records([{"figure": "x"}], f)


def test_render_markdown_table():
    recs = [_decode(), R.make_record("copy", "d2d", 4.28, "TB/s", 4.8, None, None, "H200", "c")]
    md = R.render_markdown_table(recs)
    lines = md.strip().splitlines()
    assert lines[0].startswith("| benchmark | figure | value") and len(lines) == 4
    assert "| decode | llama-3-8b b32 | 5,000 | tok/s | 7,890 | 63% | torch.compile |" in md
    assert "0.92x" in md and "| copy | d2d | 4.28 | TB/s | 4.8 | 89% | - | - | - |" in md


def test_plot_records(tmp_path):
    png = str(tmp_path / "plots" / "decode.png")
    out = R.plot_records([_decode(), R.make_record("p", "x", 3.0, "ms", None, 4.0, "hf", "g", "c")],
                         png)
    if importlib.util.find_spec("matplotlib") is None:
        assert out is None
    else:
        assert out == png and os.path.getsize(png) > 1000
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
