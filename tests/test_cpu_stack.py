"""The fast CPU path's whole-stack call (CpuOps.dense_layers -> cpu_dense.layers: every layer of a
dense model in one Numba call) against the same CpuOps layer by layer, on SmolLM2 (Q4_1 layers):
a prefill and a decode batch, all layers and a layer prefix (the layer-skip drafter's forward), on
the f32 and q8 roads; and the stack is refused where a subclass changes a layer op."""
import numpy as np
import pytest

from metrale.runtime.batch import Segment, build_batch
from metrale.runtime.cpu_ops import CpuOps

from conftest import scratch_blocks


@pytest.fixture(scope="module", params=["f32", "q8"])
def engine(request):
    from conftest import skip_without_q8
    from metrale import Engine
    if request.param == "q8":
        skip_without_q8()
    return Engine(model="smollm2-135m", device="cpu", levers={"cpu_kernels": "numba", "cpu_activations": request.param})


def _forward(engine, ids, layers, monkeypatch, stacked: bool):
    be = engine.backend
    with monkeypatch.context() as m:
        if not stacked:
            m.setattr(CpuOps, "dense_layers", lambda self, residual, count, w: None)
        with scratch_blocks(engine, len(ids) + 1) as blocks:
            prefill = be.forward(build_batch([Segment(ids, 0, blocks, logits="all")], be.block_size), num_layers=layers)
            decode = be.forward(build_batch([Segment(ids[:1], len(ids), blocks)], be.block_size), num_layers=layers)
    return prefill, decode


@pytest.mark.parametrize("layers", [None, 3])
def test_stack_equals_layer_by_layer(engine, layers, monkeypatch):
    ids = np.array([504, 3458, 282, 1029, 314, 253, 1355, 28], np.int32)
    got = _forward(engine, ids, layers, monkeypatch, stacked=True)
    want = _forward(engine, ids, layers, monkeypatch, stacked=False)
    # measured bitwise equal; the bound allows the same kernels compiled inside another function to
    # contract multiply-adds differently (float32 rounding; on the q8 road that can flip an int8)
    tol = 1e-4 if engine.backend.cpu_activations == "f32" else 1e-2
    for g, w in zip(got, want):
        assert np.abs(g - w).max() <= tol * np.abs(w).max(), np.abs(g - w).max()
        assert (np.argmax(g, -1) == np.argmax(w, -1)).mean() >= 0.85


def test_stack_is_refused_where_a_layer_op_is_overridden(engine):
    class Logged(CpuOps):
        def mlp_residual(self, residual, norm_weight, gate_up, down):
            return super().mlp_residual(residual, norm_weight, gate_up, down)

    be = engine.backend
    batch = build_batch([Segment(np.array([5], np.int32), 0, np.array([0], np.int32))], be.block_size)
    x = np.zeros((1, be.config.hidden_size), np.float32)
    assert Logged(be, batch).dense_layers(x, 1, be.weights) is None
    assert CpuOps(be, batch)._layer_stack(be.weights) is not None
