"""Accuracy-driven fallback: a model with one fragile layer meets --max-drop with that layer
float and the rest int8; the user's metric; the errors."""

import json

import numpy as np
import onnx
import pytest
from helpers import QUANTIZED_OPS, make_model, ops, rng, run
from onnx import helper as h

import onnxq
from onnxq.core.errors import ConfigError, DataError


def three_gemms(inits):
    """x[N,16] → A → Relu → B → Relu → C → y[N,8] with the Gemm weights and biases ``inits``
    (WA, BA, WB, BB, WC, BC)."""
    nodes = [
        h.make_node("Gemm", ["x", "WA", "BA"], ["a"], name="A"),
        h.make_node("Relu", ["a"], ["a1"], name="reluA"),
        h.make_node("Gemm", ["a1", "WB", "BB"], ["b"], name="B"),
        h.make_node("Relu", ["b"], ["b1"], name="reluB"),
        h.make_node("Gemm", ["b1", "WC", "BC"], ["y"], name="C"),
    ]
    inits = {k: v.astype(np.float32) for k, v in inits.items()}
    return make_model(nodes, [("x", ["N", 16])], [("y", ["N", 8])], inits)


def _fragile_mlp():
    """x → A → Relu → B → Relu → C. Input column 0 spans ±1000 but A barely reads it: an int8
    grid over x leaves the other columns a step of 8 (A's output is noise). A float, the rest
    quantizes well."""
    r = rng(11)
    wa = r.normal(0, 0.3, (16, 32))
    wa[0] = 1e-5
    inits = {
        "WA": wa, "BA": r.normal(0, 0.1, 32), "WB": r.normal(0, 0.3, (32, 32)),
        "BB": r.normal(0, 0.1, 32), "WC": r.normal(0, 0.3, (32, 8)), "BC": r.normal(0, 0.1, 8),
    }  # fmt: skip
    model = three_gemms(inits)
    x = r.normal(0, 1, (256, 16))
    x[:, 0] = r.uniform(-1000, 1000, 256)
    return model, {"x": x.astype(np.float32)}


KW = dict(progress=False, batch_size=16, rounding="nearest")


def test_the_fragile_layer_goes_float_and_the_rest_stays_int8():
    model, data = _fragile_mlp()
    plain, _ = onnxq.quantize(model, data, **KW)
    q, report = onnxq.quantize(model, data, max_drop=0.5, **KW)
    fb = report.fallback
    assert fb["met"] and fb["chosen"] == 1 and fb["held_back_batches"] == 2
    first = fb["trials"][0]
    assert first["float_groups"] == 0 and first["drop"] > 0.5  # all int8 misses the bar
    chosen = next(t for t in fb["trials"] if t["float_groups"] == 1)
    assert "A" in chosen["excluded"] and "B" not in chosen["excluded"]
    assert chosen["drop"] <= 0.5
    assert sum(op in QUANTIZED_OPS for op in ops(q)) == 2  # B and C stay int8
    assert "Gemm" in ops(q)
    # on data it never saw, the chosen model is far closer to fp32 than the all-int8 one
    x = _fragile_mlp()[1]["x"][::3] * 1.01
    ref = run(model, {"x": x})[0]
    err = [float(np.mean((run(m, {"x": x})[0] - ref) ** 2)) for m in (plain, q)]
    assert err[1] < 0.01 * err[0]
    assert "fallback:" in report.summary() and "with 1 group(s) float" in report.summary()
    # one model kept: the trials that were not chosen dropped theirs
    assert report.fallback["chosen_excluded"] == chosen["excluded"]
    assert report.to_dict()["fallback"]["chosen"] == 1


def test_user_metric_and_the_written_file(tmp_path, monkeypatch):
    model, data = _fragile_mlp()
    src = tmp_path / "m.onnx"
    onnx.save(model, str(src))
    held = data["x"][:64]
    np.save(tmp_path / "held.npy", held)
    (tmp_path / "mymetric.py").write_text(
        "import numpy as np, onnxruntime as ort\n"
        "def score(path):\n"
        "    x = np.load('held.npy')\n"
        "    f = ort.InferenceSession('m.onnx').run(None, {'x': x})[0]\n"
        "    q = ort.InferenceSession(path).run(None, {'x': x})[0]\n"
        "    return -100 * float(np.mean((f - q) ** 2) / np.mean(f ** 2))\n"
    )
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "q.onnx"
    _, report = onnxq.quantize(
        str(src), data, max_drop=1.0, metric="mymetric:score", output=out, **KW
    )
    fb = report.fallback
    assert fb["metric"] == "mymetric:score" and fb["met"] and fb["fp32"] == 0.0
    assert out.is_file()
    written = onnx.load(str(out))
    assert sum(op in QUANTIZED_OPS for op in ops(written)) == 2


def test_met_at_once_is_one_trial():
    model, data = _fragile_mlp()
    _, report = onnxq.quantize(model, data, max_drop=100.0, **KW)
    assert report.fallback["chosen"] == 0 and len(report.fallback["trials"]) == 1


def test_errors_name_the_option(tmp_path, monkeypatch):
    model, data = _fragile_mlp()
    with pytest.raises(ConfigError, match="max_drop=-1"):
        onnxq.quantize(model, data, max_drop=-1, **KW)
    with pytest.raises(ConfigError, match="metric scores the recipe choice.*recipe='fixed' pins"):
        onnxq.quantize(model, data, metric="m:f", recipe="fixed", **KW)
    with pytest.raises(ConfigError, match="measures each trial with onnxruntime"):
        onnxq.quantize(model, data, max_drop=1.0, format="openvino", **KW)
    with pytest.raises(DataError, match="holds back every 8th calibration batch"):
        onnxq.quantize(model, {"x": data["x"][:16]}, max_drop=1.0, **KW)
    (tmp_path / "badmetric.py").write_text("def score(path):\n    return 'good'\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="must return a finite number"):
        onnxq.quantize(model, data, max_drop=1.0, metric="badmetric:score", **KW)


def test_cli(tmp_path):
    from onnxq.cli import main

    model, data = _fragile_mlp()
    src, npz, out, rep = (tmp_path / n for n in ("m.onnx", "c.npz", "q.onnx", "r.json"))
    onnx.save(model, str(src))
    np.savez(npz, x=data["x"])
    args = ["quantize", str(src), "--data", str(npz), "-o", str(out), "--quiet"]
    args += ["--batch-size", "16", "--no-latency-check"]
    assert main([*args, "--max-drop", "0.5", "--report", str(rep)]) == 0 and out.is_file()
    assert json.loads(rep.read_text())["fallback"]["chosen"] == 1
    assert main([*args, "--max-drop", "-2"]) == 2


def test_edges_between_int8_and_float_count_the_chains_a_fallback_cuts():
    from onnxq.fallback import breaks

    model, data = _fragile_mlp()
    data = {"x": data["x"][:64]}
    counts = {}
    for keep in ((), ("A", "reluA"), ("B", "reluB"), ("C",)):
        _, report = onnxq.quantize(model, data, exclude=list(keep), **KW)
        counts[keep] = breaks(model, report)
    assert counts[()] == 0
    assert counts[("A", "reluA")] == 1 and counts[("C",)] == 1  # a chain's ends
    assert counts[("B", "reluB")] == 2  # the middle: int8 → float → int8


def test_of_equal_fallbacks_the_one_keeping_int8_chains_whole_is_returned():
    from onnxq.fallback import Trial, _best

    def t(groups, metric, edges, floats=None):
        floats = groups if floats is None else floats
        model = onnx.ModelProto()
        return Trial(groups, floats, [], [], metric, 100.0 - metric, 1.0, edges, model, None)

    middle, end, worse = t(1, 99.8, 2), t(1, 99.6, 1), t(2, 99.9, 0)
    assert _best([t(0, 90.0, 0), middle, end, worse], bar=0.5) is end
    assert _best([t(0, 90.0, 0), middle, worse], bar=0.5) is middle  # fewest groups first
    # of as many groups, the one keeping more of them integer (int16, not float) comes first
    wide = t(1, 99.7, 2, floats=0)
    assert _best([t(0, 90.0, 0), middle, end, wide], bar=0.5) is wide


A16W8 = dict(format="qdq", activation_dtype="int8", symmetric_activations=True)


def test_int16_fallback_keeps_the_fragile_layer_integer():
    """On a target that runs int16 activations, the fragile layer goes to int16 activations
    (its weights int8) instead of float: every Gemm stays quantized, and onnxruntime runs the
    written model as close to fp32 as the float fallback's."""
    from onnxq.annotate.targets import Target

    target = Target("test-a16w8", **A16W8, int16_activations=True)
    model, data = _fragile_mlp()
    plain, _ = onnxq.quantize(model, data, target=target, **KW)
    q, report = onnxq.quantize(model, data, target=target, max_drop=0.5, **KW)
    fb = report.fallback
    assert fb["fallback"] == "int16" and fb["met"] and fb["chosen"] == 1
    assert fb["chosen_excluded"] == [] and "A" in fb["chosen_int16"]
    chosen = next(t for t in fb["trials"] if t["int16"] == fb["chosen_int16"])
    assert chosen["float_groups"] == 0 and chosen["int16_groups"] == 1
    assert "1 group(s) at int16 activations and 0 float" in report.summary()
    assert all(d.quantized for d in report.decisions if d.op == "Gemm")
    assert ops(q).count("Gemm") == 3
    assert np.dtype(np.int16) in {onnx.numpy_helper.to_array(i).dtype for i in q.graph.initializer}
    x = _fragile_mlp()[1]["x"][::3] * 1.01
    ref = run(model, {"x": x})[0]
    err = [float(np.mean((run(m, {"x": x})[0] - ref) ** 2)) for m in (plain, q)]
    assert err[1] < 0.01 * err[0]
    # the HTML report's trials table says which groups went to int16
    from onnxq.tools.html import quantize_page

    page = quantize_page("t", model, q, report, [{"x": data["x"][:16]}])
    assert "int16 activations (int8 weights)" in page and "<th>int16 activations</th>" in page
    # asked for float on the same target: the float fallback
    _, report = onnxq.quantize(model, data, target=target, max_drop=0.5, fallback="float", **KW)
    assert report.fallback["fallback"] == "float" and "A" in report.fallback["chosen_excluded"]


def test_fallback_option_errors():
    from onnxq.annotate.targets import Target

    model, data = _fragile_mlp()
    with pytest.raises(ConfigError, match="fallback='int16' returns groups to int16 .* add "
                       "format='qdq'"):  # fmt: skip
        onnxq.quantize(model, data, max_drop=0.5, fallback="int16", **KW)
    with pytest.raises(ConfigError, match="fallback='half' is unknown"):
        onnxq.quantize(model, data, max_drop=0.5, fallback="half", format="qdq", **KW)
    with pytest.raises(ConfigError, match="add max_drop"):
        onnxq.quantize(model, data, fallback="float", **KW)
    with pytest.raises(ConfigError, match="the activations are int16 already"):
        onnxq.quantize(
            model, data, max_drop=0.5, fallback="int16", format="qdq", activation_dtype="int16",
            **KW,
        )  # fmt: skip
    with pytest.raises(ConfigError, match="target 'tensorrt' runs symmetric int8 activations "
                       "only; a target whose runtime runs int16"):  # fmt: skip
        onnxq.quantize(model, data, target="tensorrt", max_drop=0.5, fallback="int16", **KW)
    with pytest.raises(ConfigError, match="int16_activations needs format"):
        Target("bad", format="qoperator", int16_activations=True)
    # the target's choice gives way to an explicit format without int16: float
    target = Target("test-a16w8", **A16W8, int16_activations=True)
    _, report = onnxq.quantize(model, data, target=target, format="qoperator",
                               activation_dtype="uint8", symmetric_activations=False,
                               max_drop=0.5, **KW)  # fmt: skip
    assert report.fallback["fallback"] == "float"


def test_int16_groups_on_a_target_with_unsigned_relu_outputs_stay_int16():
    """unsigned_after_relu turns a symmetric int8 Relu output into uint8; a tensor two int16
    groups share stays int16 (it became uint8, and the int16 request was lost)."""
    from onnxq.annotate.config import UserConfig
    from onnxq.annotate.targets import Target

    target = Target("test-u16", **A16W8, unsigned_after_relu=True, int16_activations=True)
    model, data = _fragile_mlp()
    wide = {"A": {"activation_dtype": "int16"}, "B": {"activation_dtype": "int16"}}
    q, _ = onnxq.quantize(model, data, target=target, config=UserConfig.from_dict({"node": wide}),
                          **KW)  # fmt: skip
    zero_points = {
        i.name: onnx.numpy_helper.to_array(i).dtype
        for i in q.graph.initializer
        if i.name.endswith("zero_point")
    }
    assert zero_points["a1_int16_zero_point"] == np.int16  # A → B, both int16
    assert zero_points["b1_zero_point"] == np.uint8  # B → C (int8): after a Relu, uint8
    x = data["x"][::5] * 1.01
    ref = run(model, {"x": x})[0]
    assert float(np.mean((run(q, {"x": x})[0] - ref) ** 2)) < 1e-3 * float(np.mean(ref**2))


def test_from_python_the_fallback_metric_may_be_a_function():
    model, data = _fragile_mlp()
    seen = []

    def score(path):
        seen.append(path)
        return [1.0, 1.0]  # per-sample scores: the fallback uses their mean

    _, report = onnxq.quantize(model, data, max_drop=0.5, metric=score, **KW)
    assert report.fallback["fp32"] == 1.0 and report.fallback["met"] and seen
    assert report.fallback["metric"].endswith("<locals>.score")


def test_the_trials_are_fitted_with_the_recipe_the_first_run_chose(monkeypatch):
    import onnxq.fallback as fallback

    runs = []
    real = fallback.run_passes

    def spy(state, passes):
        asked = state.options.recipe  # the passes write the chosen recipe into the options
        done = real(state, passes)
        runs.append((asked, done.choice.get("chosen")))
        return done

    monkeypatch.setattr(fallback, "run_passes", spy)
    model, data = _fragile_mlp()
    # 64 batches: the first run chooses its recipe on held-back ones; a bar no int8 model
    # meets, so trials follow
    onnxq.quantize(model, data, max_drop=0.0, **{**KW, "batch_size": 4})
    (recipe, chosen), trials = runs[0], runs[1:]
    assert recipe == "auto" and chosen and len(trials) > 1
    assert {recipe for recipe, _ in trials} == {chosen}  # not auto's picks ("fixed")
