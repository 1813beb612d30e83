"""pytest-benchmark: the peers metrale is compared with, as benchmarks of their own, each skipped
where its peer is not installed (issue 24):

    METRALE_LLAMACPP_BIN=/path/to/llama.cpp/bin pytest bench/test_peers.py --benchmark-only -k llamacpp
    pytest bench/test_peers.py --benchmark-only -k hf            # needs torch + transformers
    pytest bench/test_peers.py --benchmark-only -m gpu           # torch.compile loop on a GPU

llama.cpp runs on the embedded SmolLM2 Q4_1 GGUF (bench.cpu_decode.llamacpp: llama-bench with
weight repacking on and off, the faster kept); HF generate and the torch.compile loop on a model
shape's random weights (bench/peers.py). extra_info carries each figure."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from bench.conftest import RECORDS


def _llamacpp_bin() -> Path | None:
    env = os.environ.get("METRALE_LLAMACPP_BIN")
    if env and (Path(env) / "llama-bench").exists():
        return Path(env)
    found = shutil.which("llama-bench")
    return Path(found).parent if found else None


def _record(benchmark, name: str, figure: dict, command: str) -> None:
    """extra_info and a bench record (bench/records.py) of a peer's tok/s, with this process's peak RSS."""
    import resource
    from bench.records import make_record
    extra = {k: v for k, v in figure.items() if isinstance(v, (int, float, str))}
    extra["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    benchmark.extra_info.update(extra)
    RECORDS.append({**make_record("peers", name, figure["tok_s"], "tok/s", None, None, None, "", command, extra),
                    "test": name})


def test_llamacpp_cpu_decode(benchmark):
    bin_dir = _llamacpp_bin()
    if bin_dir is None:
        pytest.skip("llama.cpp's llama-bench not found (set METRALE_LLAMACPP_BIN; bench/llamacpp.py builds it)")
    from bench.cpu_decode import llamacpp
    from metrale.models.registry import resolve_model
    gguf = resolve_model("smollm2-135m").path
    out: dict = {}
    benchmark.group = "peer-llamacpp-cpu"
    benchmark.pedantic(lambda: out.update(r=llamacpp(bin_dir, gguf, 2, 512)), rounds=1, iterations=1)
    r = out["r"]
    assert r["decode_b1"]["tok_s"] > 0
    _record(benchmark, "llamacpp-cpu-decode-B1", {"tok_s": r["decode_b1"]["tok_s"],
                                                  "prefill_tok_s": r["prefill"]["tok_s"],
                                                  "decode_b8_tok_s": r["decode_b8"]["tok_s"]},
            "pytest bench/test_peers.py -k llamacpp")


@pytest.mark.parametrize("batch", [1, 8])
def test_hf_generate_decode(benchmark, batch):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from bench import peers
    shape = peers.load_shape("tiny-shape")
    out: dict = {}
    benchmark.group = f"peer-hf-decode-B{batch}"
    benchmark.pedantic(lambda: out.update(r=peers.hf_generate_decode(shape, batch, context=64, steps=16)),
                       rounds=1, iterations=1)
    assert out["r"]["tok_s"] > 0
    _record(benchmark, f"hf-decode-B{batch}", out["r"], "pytest bench/test_peers.py -k hf")


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 32])
def test_torch_compiled_decode(benchmark, batch):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("the torch.compile loop is timed on a GPU")
    from bench import peers
    shape = peers.load_shape("llama-3.2-1b-shape")
    out: dict = {}
    benchmark.group = f"peer-torch-compile-B{batch}"
    benchmark.pedantic(lambda: out.update(r=peers.torch_compiled_decode(shape, batch)), rounds=1, iterations=1)
    assert out["r"]["tok_s"] > 0
    _record(benchmark, f"torch-compile-decode-B{batch}", out["r"], "pytest bench/test_peers.py -m gpu")
