"""One self-contained HTML report for ``quantize``, ``compare`` and ``debug`` (``--report F.html``).

Everything is inlined: the charts are SVG drawn by matplotlib (text kept as text, a fixed hash
salt so the same run gives the same bytes), the filter of the decisions table is a few lines of
plain JavaScript, and there is no external asset, so the file opens without a network. Sections
appear when their data exists:

* summary (model, target, the metric's figures, what was quantized);
* per-layer SQNR of the quantized model against fp32, in graph order;
* the sensitivity ranking (``debug``): each group's share of the output noise, weights and
  activations apart;
* the decisions table: every node, quantized or not, with its reason; a text filter and a
  quantized/float selector;
* range histograms of the worst tensors (largest SQNR drop) with the chosen int8 range marked;
* the accuracy–latency trade-off of the fallback or bisection steps;
* the cross-runtime check (``debug``).
"""

from __future__ import annotations

import html
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onnxq.core.errors import ConfigError
from onnxq.io.graph import tensor_array
from onnxq.lower.fakequantize import holds_fakequantize

#: the worst tensors whose range histograms are drawn
HISTOGRAMS = 6
#: values per histogram at most (evenly strided beyond)
MAX_VALUES = 1_000_000


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "an HTML report draws its charts with matplotlib; pip install matplotlib "
            '(or pip install "onnxq[report]"), or write a .json report'
        ) from None
    matplotlib.use("Agg")
    matplotlib.rcParams.update(
        {"svg.fonttype": "none", "svg.hashsalt": "onnxq", "font.size": 9, "axes.grid": True}
    )
    import matplotlib.pyplot as plt

    return plt


def _svg(fig: Any) -> str:
    plt = _pyplot()
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg") :]


def layer_chart(layers: Sequence[tuple[str, float]]) -> str:
    """Per-layer SQNR in graph order: (layer, dB) pairs."""
    plt = _pyplot()
    n = len(layers)
    fig, ax = plt.subplots(figsize=(min(14, 4 + 0.08 * n), 3.2))
    values = [v if math.isfinite(v) else 80.0 for _, v in layers]
    colours = ["#c0392b" if v < 20 else "#e67e22" if v < 30 else "#27ae60" for v in values]
    ax.bar(range(n), values, color=colours, width=0.85)
    ax.set_xlabel("layer, in graph order (every layer is in the table below)")
    ax.set_ylabel("SQNR vs fp32 (dB)")
    ax.set_xlim(-1, n)
    step = max(1, n // 30)
    ax.set_xticks(range(0, n, step))
    ax.set_xticklabels([_cut(layers[i][0], 18) for i in range(0, n, step)], rotation=70, ha="right")
    return _svg(fig)


def ranking_chart(groups: Sequence[Any], limit: int = 20, returned: str = "float") -> str:
    """The best-ranked groups' shares of the output noise (onnxq.simulate.sensitivity)."""
    plt = _pyplot()
    top = list(groups)[:limit][::-1]
    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.25 * len(top)))
    y = np.arange(len(top))
    ax.barh(y - 0.2, [100 * g.alone_share for g in top], 0.4, label="noise it adds alone")
    # no bar for a group the budget left unmeasured returned (float_share None)
    gone = [np.nan if g.float_share is None else 100 * g.float_share for g in top]
    ax.barh(y + 0.2, gone, 0.4, label=f"noise gone when {returned}")
    ax.set_yticks(y)
    ax.set_yticklabels([f"{_cut(g.node, 28)} ({g.dominant})" for g in top])
    ax.set_xlabel("% of the whole model's output noise")
    ax.legend(loc="lower right")
    return _svg(fig)


def histogram_chart(tensors: Sequence[tuple[str, np.ndarray, float, float]]) -> str:
    """Value histograms (log counts) of tensors with their int8 range [lo, hi] marked."""
    plt = _pyplot()
    cols = 3
    rows = max(1, math.ceil(len(tensors) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(11, 2.6 * rows), squeeze=False)
    for ax in axes.ravel()[len(tensors) :]:
        ax.axis("off")
    for ax, (name, values, lo, hi) in zip(axes.ravel(), tensors, strict=False):
        v = np.asarray(values, np.float64).ravel()
        edges = np.linspace(min(v.min(), lo), max(v.max(), hi), 121)
        counts, edges = np.histogram(v, edges)
        ax.stairs(counts, edges, fill=True, color="#5d8aa8")
        ax.set_yscale("log")
        for x in (lo, hi):
            ax.axvline(x, color="#c0392b", linewidth=1.2)
        clipped = float(np.mean((v < lo) | (v > hi)))
        ax.set_title(
            f"{_cut(name, 34)}\nint8 range [{lo:.3g}, {hi:.3g}], {100 * clipped:.3f}% clipped"
        )
    fig.tight_layout()
    return _svg(fig)


def tradeoff_chart(
    points: Sequence[tuple[int, float, float | None]], fp32: float, returned: str = "float"
) -> str:
    """Metric against int8 latency (or groups) of each step: (groups, metric, ms).

    ``returned``: what the groups went back to, for the labels ("float", "int16", "returned").
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    timed = all(ms is not None for _, _, ms in points)
    xs = [ms if timed else g for g, _, ms in points]
    ax.plot(xs, [m for _, m, _ in points], "o", color="#2c3e50")
    for (g, m, _), x in zip(points, xs, strict=True):
        ax.annotate(f"{g} {returned}", (x, m), textcoords="offset points", xytext=(4, 4))
    ax.axhline(fp32, color="#27ae60", linestyle="--", label="fp32")
    ax.set_xlabel("int8 latency per batch (ms, 1 thread)" if timed else f"groups {returned}")
    ax.set_ylabel("metric")
    ax.legend()
    return _svg(fig)


def _cut(name: str, width: int) -> str:
    return name if len(name) <= width else "…" + name[-(width - 1) :]


@dataclass
class Report:
    """The sections of one report, rendered by :meth:`html`."""

    title: str
    summary: list[tuple[str, str]] = field(default_factory=list)
    #: (heading, explanation, inline SVG or HTML)
    sections: list[tuple[str, str, str]] = field(default_factory=list)
    #: the decisions table: (node, op, "int8"/"float", pattern, reason)
    decisions: list[tuple[str, str, str, str, str]] = field(default_factory=list)

    def add(self, heading: str, text: str, body: str) -> None:
        """Append a section."""
        self.sections.append((heading, text, body))

    def html(self) -> str:
        """The whole page."""
        e = html.escape
        parts = [
            "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
            f"<title>{e(self.title)}</title><style>{_CSS}</style></head><body>",
            f"<h1>{e(self.title)}</h1>",
            "<section id='summary'><h2>Summary</h2><table class='kv'>",
            *(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in self.summary),
            "</table></section>",
        ]
        for i, (heading, text, body) in enumerate(self.sections):
            parts.append(
                f"<section id='s{i}' class='chart'><h2>{e(heading)}</h2><p>{e(text)}</p>"
                f"{body}</section>"
            )
        if self.decisions:
            rows = "".join(
                f"<tr class='{e(q)}'><td>{e(n)}</td><td>{e(o)}</td><td>{e(q)}</td>"
                f"<td>{e(p)}</td><td>{e(r)}</td></tr>"
                for n, o, q, p, r in self.decisions
            )
            parts.append(
                "<section id='decisions'><h2>Decisions</h2>"
                "<p>Every node of the float model, quantized or not, with the reason.</p>"
                "<input id='filter' type='search' placeholder='filter: node, op, reason'>"
                "<select id='which'><option value=''>all</option><option value='int8'>int8"
                "</option><option value='float'>float</option></select> "
                "<span id='shown'></span>"
                "<table id='decisions-table'><thead><tr><th>node</th><th>op</th><th>kept as"
                f"</th><th>pattern</th><th>reason</th></tr></thead><tbody>{rows}</tbody>"
                f"</table></section><script>{_JS}</script>"
            )
        parts.append("</body></html>")
        return "".join(parts)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain HTML table."""
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{e(_fmt(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.4g}"
    return str(value)


_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;max-width:1200px;color:#222}
h1{font-size:1.4em}h2{font-size:1.15em;border-bottom:1px solid #ccc;margin-top:1.6em}
table{border-collapse:collapse;font-size:.85em}td,th{border:1px solid #ddd;padding:2px 6px;
text-align:left;vertical-align:top}tr.float td:nth-child(3){color:#c0392b}
table.kv th{background:#f4f4f4}svg{max-width:100%;height:auto}
#filter{width:24em;margin:.4em .4em .4em 0}
"""

_JS = """
(function(){
  var f=document.getElementById('filter'),w=document.getElementById('which'),
      rows=document.querySelectorAll('#decisions-table tbody tr'),
      shown=document.getElementById('shown');
  function apply(){
    var q=f.value.toLowerCase(),k=w.value,n=0;
    rows.forEach(function(r){
      var ok=(!q||r.textContent.toLowerCase().indexOf(q)>=0)&&(!k||r.className===k);
      r.style.display=ok?'':'none'; if(ok){n++;}
    });
    shown.textContent=n+' of '+rows.length+' nodes';
  }
  f.addEventListener('input',apply);w.addEventListener('change',apply);apply();
})();
"""


def int8_range(model: Any, tensor: str) -> tuple[float, float] | None:
    """The range a quantized model gives ``tensor`` (None when it has none).

    From ``<tensor>_scale`` and its zero point (QOperator, QDQ) or its FakeQuantize bounds
    (OpenVINO).
    """
    from onnxq.core.qparams import qrange

    inits = {i.name: i for i in model.graph.initializer}
    scale, zero = inits.get(f"{tensor}_scale"), inits.get(f"{tensor}_zero_point")
    if scale is not None and zero is not None:
        s = tensor_array(scale).astype(np.float64)
        z = tensor_array(zero)
        if s.size != 1:
            return None
        dtype = {np.dtype(np.uint8): "uint8", np.dtype(np.int8): "int8"}.get(z.dtype, "int16")
        lo, hi = qrange(dtype)
        zf = float(z.reshape(-1)[0])
        return (lo - zf) * float(s.reshape(())), (hi - zf) * float(s.reshape(()))
    low, high = inits.get(f"{tensor}/input_low"), inits.get(f"{tensor}/input_high")
    if low is not None and high is not None:
        lo_v, hi_v = tensor_array(low), tensor_array(high)
        if lo_v.size == 1:
            return float(lo_v.reshape(())), float(hi_v.reshape(()))
    return None


def worst_histograms(
    float_model: Any, quant_model: Any, comparison: Any, feeds: Sequence[dict[str, Any]]
) -> list[tuple[str, np.ndarray, float, float]]:
    """The float values of the tensors with the largest SQNR drop and their int8 ranges."""
    from onnxq.io.session import make_session

    chosen: list[tuple[str, tuple[float, float]]] = []
    for layer in comparison.layers:  # largest drop first
        bounds = int8_range(quant_model, layer.name)
        if bounds is not None:
            chosen.append((layer.name, bounds))
        if len(chosen) == HISTOGRAMS:
            break
    if not chosen or not feeds:
        return []
    names = [n for n, _ in chosen]
    session = make_session(float_model, expose=names)
    values: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for feed in feeds[:8]:
        for n, v in zip(names, session.run(names, feed), strict=True):
            values[n].append(np.asarray(v, np.float32).ravel())
    drawn = []
    for n, (lo, hi) in chosen:
        v = np.concatenate(values[n])
        if v.size > MAX_VALUES:  # every k-th value: the same shape, a bounded page and memory
            v = v[:: -(-v.size // MAX_VALUES)]
        drawn.append((n, v, lo, hi))
    return drawn


def comparison_sections(
    report: Report,
    float_model: Any,
    quant_model: Any,
    comparison: Any,
    feeds: Sequence[dict[str, Any]],
) -> None:
    """The per-layer chart, the layer table and the worst tensors' histograms."""
    by_order = sorted(comparison.layers, key=lambda s: s.order)
    if by_order:
        report.add(
            "Per-layer SQNR",
            f"SQNR of every compared tensor against fp32 on {comparison.samples} samples, in "
            "graph order (red < 20 dB, orange < 30 dB).",
            layer_chart([(s.node or s.name, s.sqnr_db) for s in by_order]),
        )
    hist = worst_histograms(float_model, quant_model, comparison, feeds)
    if hist:
        report.add(
            "Ranges of the worst tensors",
            "Float values (log counts) of the tensors that lose the most SQNR themselves, with "
            "the int8 range chosen for them in red: values outside it are clipped, and the "
            "wider it is, the coarser its 256 steps.",
            histogram_chart(hist),
        )
    report.add(
        "Outputs and layers",
        "Largest drop first: the SQNR a layer loses itself (its inputs' minus its own).",
        table(
            ["node", "op", "tensor", "SQNR dB", "drop dB", "cosine"],
            [
                (s.node, s.op, s.name, s.sqnr_db, s.drop_db, s.cosine)
                for s in [*comparison.outputs, *comparison.layers]
            ],
        ),
    )


def compare_page(
    title: str, float_model: Any, quant_model: Any, comparison: Any, feeds: Sequence[Any]
) -> str:
    """The report of ``onnxq compare``."""
    page = Report(title)
    page.summary = [("samples", str(comparison.samples))] + [
        (f"output {s.name}", f"SQNR {s.sqnr_db:.2f} dB, cosine {s.cosine:.5f}")
        for s in comparison.outputs
    ]
    comparison_sections(page, float_model, quant_model, comparison, feeds)
    return page.html()


def quantize_page(
    title: str, float_model: Any, quant_model: Any, report: Any, feeds: Sequence[Any]
) -> str:
    """The report of ``onnxq quantize``: its summary, decisions, layers and any fallback."""
    from onnxq.calibrate.dataset import model_inputs
    from onnxq.calibrate.sources import as_dataset
    from onnxq.options import returned_label
    from onnxq.simulate.compare import compare

    page = Report(title)
    page.summary = [("summary", line) for line in report.summary().splitlines() if line.strip()]
    fb = report.fallback
    if fb:
        page.add(
            "Accuracy and latency of the fallback's trials",
            f"Metric: {fb['metric']} on {fb['held_back_batches']} held-back batch(es); each "
            "trial is a full quantization with those groups float"
            + ("." if fb["fallback"] == "float" else " or at int16 activations (int8 weights)."),
            tradeoff_chart(
                [(t["groups"], t["metric"], t["int8_ms"]) for t in fb["trials"]],
                fb["fp32"],
                returned_label(fb["fallback"]),
            )
            + table(
                ["groups", "metric", "drop", "int8 ms", "float", "int16 activations"],
                [
                    (
                        t["groups"],
                        t["metric"],
                        t["drop"],
                        t["int8_ms"],
                        " ".join(t["excluded"]),
                        " ".join(t["int16"]),
                    )
                    for t in fb["trials"]
                ],
            ),
        )
    if quant_model is not None and not holds_fakequantize(quant_model):
        comparison = compare(
            float_model, quant_model, as_dataset(list(feeds), model_inputs(float_model))
        )
        comparison_sections(page, float_model, quant_model, comparison, feeds)
    page.decisions = [
        (d.node, d.op, "int8" if d.quantized else "float", d.pattern, d.reason)
        for d in report.decisions
    ]
    return page.html()
