"""The pattern language: a match and a no-match test for every construct."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from helpers import make_model
from onnx import helper as h

from onnxq.core.errors import PatternError
from onnxq.io.graph import import_graph
from onnxq.pattern import (
    DFPatternCallback,
    find_all,
    has_attr,
    is_constant,
    is_input,
    is_op,
    match,
    match_explain,
    partition,
    rewrite,
    wildcard,
)

W = np.ones((4, 3, 3, 3), np.float32)
B = np.zeros(4, np.float32)


def graph_of(nodes, inputs=(("x", [1, 3, 8, 8]),), outputs=(("y", None),), inits=None):
    return import_graph(make_model(nodes, list(inputs), list(outputs), inits))


def tensor(g: gs.Graph, name: str) -> gs.Tensor:
    return g.tensors()[name]


def conv_relu_graph(extra_consumer: bool = False, as_output: bool = False):
    nodes = [
        h.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        h.make_node("Relu", ["c"], ["y"], name="relu"),
    ]
    outputs = [("y", None)]
    if extra_consumer:
        nodes.append(h.make_node("Sigmoid", ["c"], ["z"], name="sig"))
        outputs.append(("z", None))
    if as_output:
        outputs.append(("c", None))
    return graph_of(nodes, outputs=outputs, inits={"W": W, "B": B})


# leaves ---------------------------------------------------------------------------------------


def test_match_wildcard_and_op():
    g = conv_relu_graph()
    assert match(is_op("Relu")(wildcard()), tensor(g, "y")) is not None


def test_no_match_wrong_op_gives_reason():
    g = conv_relu_graph()
    res = match_explain(is_op("Sigmoid")(wildcard()), tensor(g, "y"))
    assert not res.ok and "is Relu, expected Sigmoid" in res.reason


def test_match_is_constant_initializer():
    g = conv_relu_graph()
    m = match(is_op("Conv")(wildcard(), is_constant(), is_constant()), tensor(g, "c"))
    assert m is not None


def test_match_is_constant_constant_node():
    nodes = [
        h.make_node("Constant", [], ["k"], name="k", value=h.make_tensor("v", 1, [1], [2.0])),
        h.make_node("Mul", ["x", "k"], ["y"], name="mul"),
    ]
    g = graph_of(nodes)
    assert match(is_op("Mul")(wildcard(), is_constant()), tensor(g, "y")) is not None


def test_no_match_is_constant_on_activation():
    g = graph_of([h.make_node("Add", ["x", "x"], ["y"], name="add")])
    res = match_explain(is_op("Add")(wildcard(), is_constant()), tensor(g, "y"))
    assert not res.ok and "is not a constant" in res.reason


def test_match_is_input():
    g = graph_of([h.make_node("Relu", ["x"], ["y"], name="r")])
    assert match(is_op("Relu")(is_input("x")), tensor(g, "y")) is not None
    assert match(is_op("Relu")(is_input()), tensor(g, "y")) is not None


def test_no_match_is_input():
    g = conv_relu_graph()
    assert match(is_op("Relu")(is_input()), tensor(g, "y")) is None
    g2 = graph_of([h.make_node("Relu", ["x"], ["y"], name="r")])
    assert match(is_op("Relu")(is_input("other")), tensor(g2, "y")) is None


# optional inputs and arity -------------------------------------------------------------------


def test_match_absent_optional_input():
    g = graph_of([h.make_node("Conv", ["x", "W"], ["y"], name="conv")], inits={"W": W})
    assert match(is_op("Conv")(wildcard(), is_constant(), None), tensor(g, "y")) is not None
    assert match(is_op("Conv")(wildcard(), is_constant()), tensor(g, "y")) is not None


def test_no_match_present_input_where_absent_required():
    g = conv_relu_graph()
    res = match_explain(is_op("Conv")(wildcard(), is_constant(), None), tensor(g, "c"))
    assert not res.ok and "present" in res.reason
    res = match_explain(is_op("Conv")(wildcard(), is_constant()), tensor(g, "c"))
    assert not res.ok and "has 3 inputs" in res.reason


def test_no_match_missing_required_input():
    g = graph_of([h.make_node("Conv", ["x", "W"], ["y"], name="conv")], inits={"W": W})
    res = match_explain(is_op("Conv")(wildcard(), wildcard(), wildcard()), tensor(g, "y"))
    assert not res.ok and "absent" in res.reason


# predicates ----------------------------------------------------------------------------------


def test_match_has_attr_including_schema_default():
    g = conv_relu_graph()
    c = tensor(g, "c")
    assert (
        match(
            is_op("Conv")(wildcard(), wildcard(), wildcard()).has_attr(
                {"pads": [1, 1, 1, 1], "group": 1}
            ),
            c,
        )
        is not None
    )
    assert match(has_attr({"group": 1}, is_op("Conv")), c) is not None


def test_no_match_has_attr():
    g = conv_relu_graph()
    res = match_explain(is_op("Conv").has_attr({"group": 2}), tensor(g, "c"))
    assert not res.ok and "group=1, expected 2" in res.reason


def test_match_and_no_match_dtype_shape_rank():
    g = conv_relu_graph()
    x = tensor(g, "x")
    assert match(wildcard().has_dtype(np.float32), x) is not None
    assert match(wildcard().has_dtype(np.int64), x) is None
    assert match(wildcard().has_shape([1, 3, None, 8]), x) is not None
    assert match(wildcard().has_shape([1, 4, 8, 8]), x) is None
    assert match(wildcard().has_rank(4), x) is not None
    res = match_explain(wildcard().has_rank(2), x)
    assert not res.ok and "rank 4, expected 2" in res.reason


def test_match_and_no_match_check():
    g = conv_relu_graph()
    p = is_constant().check(lambda t: t.values.shape[0] == 4, "needs 4 output channels")
    assert match(is_op("Conv")(wildcard(), p, wildcard()), tensor(g, "c")) is not None
    q = is_constant().check(lambda t: t.values.shape[0] == 8, "needs 8 output channels")
    res = match_explain(is_op("Conv")(wildcard(), q, wildcard()), tensor(g, "c"))
    assert not res.ok and "needs 8 output channels" in res.reason


# combinators ---------------------------------------------------------------------------------


def test_match_alternative():
    g = conv_relu_graph()
    p = is_op("Sigmoid")(wildcard()) | is_op("Relu")(wildcard())
    assert match(p, tensor(g, "y")) is not None
    op_alt = (is_op("Sigmoid") | is_op("Relu"))(wildcard())
    assert match(op_alt, tensor(g, "y")) is not None


def test_no_match_alternative():
    g = conv_relu_graph()
    assert match(is_op("Sigmoid")(wildcard()) | is_op("Tanh")(wildcard()), tensor(g, "y")) is None


def test_optional_matches_with_and_without():
    g = conv_relu_graph()
    conv = is_op("Conv")(wildcard(), is_constant(), is_constant())
    p = conv.optional(lambda q: is_op("Relu")(q))
    with_relu = match(p, tensor(g, "y"))
    without = match(p, tensor(g, "c"))
    assert with_relu is not None and len(with_relu.nodes) == 2
    assert without is not None and len(without.nodes) == 1
    assert match(p, tensor(g, "x")) is None


def test_commutative_add_matches_either_order():
    g = graph_of(
        [h.make_node("Add", ["k", "x"], ["y"], name="add")],
        inits={"k": np.ones((1, 3, 8, 8), np.float32)},
    )
    assert match(is_op("Add")(wildcard(), is_constant()), tensor(g, "y")) is not None


def test_non_commutative_sub_does_not_swap():
    g = graph_of(
        [h.make_node("Sub", ["k", "x"], ["y"], name="sub")],
        inits={"k": np.ones((1, 3, 8, 8), np.float32)},
    )
    assert match(is_op("Sub")(wildcard().has_dtype(np.float32), is_input()), tensor(g, "y"))
    assert match(is_op("Sub")(is_input(), is_constant()), tensor(g, "y")) is None
    assert match(is_op("Sub", commutative=True)(is_input(), is_constant()), tensor(g, "y"))


def test_multi_output_index():
    g = graph_of(
        [
            h.make_node("Split", ["x"], ["a", "b"], axis=1, name="split"),
            h.make_node("Relu", ["b"], ["y"], name="relu"),
            h.make_node("Relu", ["a"], ["z"], name="relu_a"),
        ],
        inputs=(("x", [1, 4, 8, 8]),),
        outputs=(("y", None), ("z", None)),
    )
    split = is_op("Split")(wildcard())
    assert match(is_op("Relu")(split[1]), tensor(g, "y")) is not None
    res = match_explain(is_op("Relu")(split[1]), tensor(g, "z"))
    assert not res.ok and "expected output 1" in res.reason
    assert match(is_op("Relu")(split), tensor(g, "z")) is not None


def test_same_pattern_binds_same_tensor():
    g = graph_of([h.make_node("Add", ["x", "x"], ["y"], name="add")])
    x = wildcard()
    assert match(is_op("Add")(x, x), tensor(g, "y")) is not None
    g2 = graph_of(
        [h.make_node("Add", ["x", "k"], ["y"], name="add")],
        inits={"k": np.ones((1, 3, 8, 8), np.float32)},
    )
    res = match_explain(is_op("Add")(x, x), tensor(g2, "y"))
    assert not res.ok and "bound earlier" in res.reason


def test_calling_a_leaf_is_an_error():
    with pytest.raises(PatternError):
        wildcard()(wildcard())


# grouping, partition, rewrite ----------------------------------------------------------------


def _conv_relu_pattern():
    conv = is_op("Conv")(wildcard(), is_constant(), is_constant())
    return conv.optional(lambda q: is_op("Relu")(q)), conv


def test_partition_groups_conv_relu_once():
    g = conv_relu_graph()
    p, _ = _conv_relu_pattern()
    part = partition([p], g)
    assert len(part.groups) == 1
    assert sorted(n.name for n in part.groups[0].nodes) == ["conv", "relu"]


def test_escape_rule_rejects_interior_used_outside():
    g = conv_relu_graph(extra_consumer=True)
    relu_only = is_op("Relu")(is_op("Conv")(wildcard(), is_constant(), is_constant()))
    part = partition([relu_only], g)
    assert part.groups == []
    reasons = [a.reason for a in part.reasons_for("relu")]
    assert any("also read by Sigmoid node 'sig'" in r for r in reasons)
    # with the optional Relu, the Conv alone is grouped instead
    p, _ = _conv_relu_pattern()
    part2 = partition([p], g)
    assert [n.name for n in part2.groups[0].nodes] == ["conv"]


def test_escape_rule_rejects_interior_graph_output():
    g = conv_relu_graph(as_output=True)
    relu_only = is_op("Relu")(is_op("Conv")(wildcard(), is_constant(), is_constant()))
    part = partition([relu_only], g)
    assert part.groups == [] and "graph output" in part.reasons_for("relu")[0].reason


def test_partition_no_overlap_and_priority():
    nodes = [
        h.make_node("Relu", ["x"], ["a"], name="r1"),
        h.make_node("Relu", ["a"], ["y"], name="r2"),
    ]
    g = graph_of(nodes)
    single = is_op("Relu")(wildcard())
    double = is_op("Relu")(is_op("Relu")(wildcard()))
    part = partition([single, double], g)  # larger pattern first by default
    assert len(part.groups) == 1 and len(part.groups[0].nodes) == 2
    part2 = partition([DFPatternCallback(single, priority=10), DFPatternCallback(double)], g)
    assert len(part2.groups) == 2 and all(len(gr.nodes) == 1 for gr in part2.groups)


def test_find_all_reports_overlapping_matches():
    g = graph_of(
        [h.make_node("Relu", ["x"], ["a"], name="r1"), h.make_node("Relu", ["a"], ["y"], name="r2")]
    )
    assert len(find_all(is_op("Relu")(wildcard()), g)) == 2


class ReluToClip(DFPatternCallback):
    def __init__(self):
        super().__init__(is_op("Relu")(wildcard()))
        self.x = self.pattern.args[0]

    def callback(self, pre, post, node_map):
        out = self.editor.variable(pre.name + "_clip", np.float32, pre.shape)
        lo = self.editor.constant("zero", np.zeros((), np.float32))
        self.editor.add_node("Clip", [node_map[self.x][0], lo], [out], name="clip")
        return out


def test_rewrite_callback_fixed_point_and_numerics():
    from helpers import run

    from onnxq.io.graph import export_model

    model = make_model(
        [
            h.make_node("Relu", ["x"], ["a"], name="r1"),
            h.make_node("Relu", ["a"], ["y"], name="r2"),
        ],
        [("x", [2, 3])],
        [("y", [2, 3])],
    )
    g = import_graph(model)
    res = rewrite(ReluToClip(), g)
    assert res.modified and res.converged and res.iterations == 2
    out = export_model(g, model)
    assert [n.op_type for n in out.graph.node] == ["Clip", "Clip"]
    assert out.graph.output[0].name == "y"
    x = np.array([[-1, 0, 2], [3, -4, 5]], np.float32)
    np.testing.assert_array_equal(run(out, {"x": x})[0], run(model, {"x": x})[0])


class Flip(DFPatternCallback):
    """Rewrites Relu into Relu forever: the fixed point must stop at the bound."""

    def __init__(self):
        super().__init__(is_op("Relu")(wildcard()))

    def callback(self, pre, post, node_map):
        out = self.editor.variable(pre.name + "_again", np.float32, pre.shape)
        self.editor.add_node("Relu", [self.match.node(self.pattern).inputs[0]], [out], "relu")
        return out


def test_rewrite_is_bounded():
    g = graph_of([h.make_node("Relu", ["x"], ["y"], name="r")])
    res = rewrite(Flip(), g, max_iterations=3)
    assert res.iterations == 3 and not res.converged


def test_failures_are_structured_with_kind_and_source():
    """explain reads the kind and the node of a near miss, not its wording."""
    from onnxq.pattern import is_op, partition, wildcard

    nodes = [
        h.make_node("Conv", ["x", "W"], ["c"], name="conv"),
        h.make_node("Sigmoid", ["c"], ["s"], name="sig"),
        h.make_node("Add", ["c", "s"], ["y"], name="add"),
    ]
    model = make_model(
        nodes, [("x", [1, 2, 4, 4])], [("y", None)], {"W": np.ones((2, 2, 1, 1), np.float32)}
    )
    graph = import_graph(model)
    sig_relu = is_op("Sigmoid")(is_op("Relu")(wildcard()))  # the input is a Conv: wrong op
    sig_conv = is_op("Sigmoid")(is_op("Conv")(wildcard(), wildcard()))  # conv's c escapes
    part = partition([sig_relu, sig_conv], graph)
    got = {(a.kind, a.source) for a in part.reasons_for("sig") if not a.accepted}
    assert got == {("op", "conv"), ("escape", "add")}
