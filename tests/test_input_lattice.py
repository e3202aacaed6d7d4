"""scripts/input_lattice.py: the half-step shift onto the pixel lattice, and the pinned grid."""

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import input_lattice  # noqa: E402

import onnxq  # noqa: E402


def _conv(pads):
    from helpers import make_model

    gen = np.random.default_rng(3)
    node = onnx.helper.make_node("Conv", ["x", "W", "B"], ["y"], name="conv", pads=pads)
    inits = {
        "W": gen.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32),
        "B": gen.normal(0, 0.1, (4,)).astype(np.float32),
    }
    return make_model([node], [("x", ["N", 3, 8, 8])], [("y", None)], inits)


def _pixels(n):
    """Images normalized as (p/255 − 0.5)/0.5, every pixel value 0..255 present."""
    p = np.random.default_rng(4).integers(0, 256, (n, 3, 8, 8))
    p.reshape(-1)[:256] = np.arange(256)
    return ((p / 255.0 - 0.5) / 0.5).astype(np.float32)


def _run(model, x):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def test_the_shift_is_exact_inside_and_off_by_the_padded_taps_at_the_border():
    x = _pixels(2)
    moved = input_lattice.shifted(_conv([1, 1, 1, 1]))
    ref = _run(_conv([1, 1, 1, 1]), x)
    got = _run(moved, x + input_lattice.SHIFT)
    np.testing.assert_allclose(got[:, :, 1:-1, 1:-1], ref[:, :, 1:-1, 1:-1], atol=1e-5)
    w = onnx.numpy_helper.to_array(_conv([1, 1, 1, 1]).graph.initializer[0])
    # the top-left output misses the taps of the padded row 0 and column 0 (5 of 9)
    padded = w[:, :, 0, :].sum(axis=(1, 2)) + w[:, :, 1:, 0].sum(axis=(1, 2))
    np.testing.assert_allclose(
        got[:, :, 0, 0] - ref[:, :, 0, 0],
        np.broadcast_to(-input_lattice.SHIFT * padded, (2, 4)),
        atol=1e-5,
    )
    # no padding: exact everywhere
    exact = _run(input_lattice.shifted(_conv([0, 0, 0, 0])), x + input_lattice.SHIFT)
    np.testing.assert_allclose(exact, _run(_conv([0, 0, 0, 0]), x), atol=1e-5)


def test_the_pinned_grid_holds_the_shifted_pixels_exactly():
    x = _pixels(16) + input_lattice.SHIFT
    step = float(input_lattice.STEP)
    pinned = input_lattice.PinnedInput("x", -127 * step, 128 * step)
    q, _ = onnxq.quantize(_conv([0, 0, 0, 0]), {"x": x}, callback=pinned, progress=False)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in q.graph.initializer}
    read = next(n for n in q.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "x")
    assert inits[read.input[1]] == pytest.approx(step, rel=1e-6)
    assert int(inits[read.input[2]]) == 127
    # what the int8 model reads, run by onnxruntime, is the input itself
    h = onnx.helper
    probe = h.make_model(
        h.make_graph(
            [
                h.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
                h.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
            ],
            "probe",
            [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, None)],
            [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
            [
                onnx.numpy_helper.from_array(inits[read.input[1]], "s"),
                onnx.numpy_helper.from_array(inits[read.input[2]], "z"),
            ],
        ),
        opset_imports=[h.make_opsetid("", 13)],
    )
    np.testing.assert_allclose(_run(probe, x), x, atol=1e-6)
