"""Rules reach onnxq only through the pattern façade and the spec modules."""

import ast
from pathlib import Path

RULES = Path(__file__).resolve().parents[2] / "patterns"
ALLOWED = {
    "onnxq.pattern",  # the pattern language and the graph queries rules need
    "onnxq.patterns.rule",  # QuantizerPattern
    "onnxq.core.specs",  # the records a rule writes
    "onnxq.core.optable",  # the quantized ops
    "onnxq.core.callbacks",  # the calibration protocol a rule may carry
    "onnxq.prepare.fusions",  # the GELU rule reuses the GELU fusion's pattern
}


def test_rules_import_only_the_facade_and_specs():
    bad = []
    for path in sorted(RULES.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("onnxq"):
                mod = node.module
                if mod not in ALLOWED and not mod.startswith("onnxq.patterns"):
                    bad.append(f"{path.name}: {mod}")
    assert not bad, bad
