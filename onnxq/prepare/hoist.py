"""Move a recurrent body's input projection out of its Loop or Scan: one GEMM for all steps.

A recurrent step written as a Scan or Loop body multiplies the step's input row by a constant
weight every step (``MatMul(x_t, W_i)``, often plus a constant bias; a Gemm where a framework
wrote a Linear layer), beside the hidden state's own product. That product depends on
nothing the steps carry, so it can be computed for every step at once before the loop, as
one ``MatMul(X, W_i)`` over the whole sequence, and the body reads its step's row of the
result:

- **Scan**: ``x_t`` is a scan input; the product over the sequence becomes a new scan input
  (same direction, steps on axis 0) and replaces the body's MatMul.
- **Loop**: ``x_t = Gather(X, i)`` of an outer tensor ``X`` along the iteration counter; the
  body gathers row ``i`` of ``MatMul(X, W_i)`` instead. Only where the trip count is
  ``X``'s length on that axis, a constant equal to it or read from ``X``'s shape (no row is
  multiplied for nothing).

The body then does one GEMM of one row a step instead of two, and the hoisted one runs as a
single batched GEMM, which int8 kernels do well (a one-row int8 GEMM per step is slower than
the float one on onnxruntime's CPU kernels). The arithmetic is the same; only the order of
the float sums inside a GEMM may differ. Before that, the few ops exporters write inside a
loop on outer values only (TorchScript slices ``x[:]`` every step for ``x[:, t]``) move out,
or go where they change nothing.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import onnx_graphsurgeon as gs

from onnxq.io.graph import GraphEditor, constant_value, is_absent, producer


def hoist_projections(
    graph: gs.Graph, kept: Collection[str] = (), taken: Collection[str] = ()
) -> list[str]:
    """Hoist the input projections of ``graph``'s Loop and Scan bodies; return what moved.

    The nodes that compute the same value every step go first (:func:`_invariants`), so that
    a projection of ``x[:, t]`` as TorchScript writes it reads an outer tensor. ``kept``: names
    of If/Loop/Scan nodes left as they are, bodies and all (the user keeps them float). Each
    entry of the result reads ``'<body node>' of '<Loop/Scan>'``. Nested
    bodies are visited too, each hoisting into the graph that holds its node; ``taken``: the
    names of the scopes around ``graph``, which new names avoid.
    """
    editor = GraphEditor(graph)
    editor.reserve(_all_names(graph))
    editor.reserve(taken)
    moved: list[str] = []
    for node in list(graph.nodes):
        if node.name in kept:
            continue
        for body in [v for v in node.attrs.values() if isinstance(v, gs.Graph)]:
            moved += hoist_projections(body, kept, editor.names())
        body = node.attrs.get("body")
        if node.op not in ("Scan", "Loop") or not isinstance(body, gs.Graph):
            continue
        invariant = _invariants(editor, node, body)
        moved += [f"'{n}' of '{node.name}' (the same every step)" for n in invariant]
        hoist = _hoist_scan if node.op == "Scan" else _hoist_loop
        for mm in list(body.nodes):
            if mm.op in ("MatMul", "Gemm") and hoist(editor, node, body, mm):
                moved.append(f"'{mm.name}' of '{node.name}'")
    if moved:
        editor.finish()
    return moved


#: ops moved out of a body when every input comes from outside it: those exporters write
#: inside loops for ``x[:, t]`` and the like, and which cannot fail where the loop would not
#: (a moved node also runs when the loop runs no step)
_INVARIANT_OPS = ("Slice", "Cast", "Transpose", "Identity", "Unsqueeze")


def _invariants(editor: GraphEditor, holder: gs.Node, body: gs.Graph) -> list[str]:
    """Move the nodes of ``body`` that compute the same value every step to ``editor``'s graph.

    A node of :data:`_INVARIANT_OPS` whose inputs all come from outside the body (outer
    values, constants no other body node reads) and whose outputs are not body outputs; a
    Slice that keeps everything (starts 0, steps 1, ends past any length: TorchScript's
    ``x[:, t]`` slices ``x[:]`` every step) is dropped instead. Repeated until none is left.
    Returns the names of the nodes moved or dropped.
    """
    own = {id(t) for t in body.inputs}
    done: list[str] = []
    changed = True
    while changed:
        changed = False
        made = {id(o) for n in body.nodes for o in n.outputs}
        outputs = {id(t) for t in body.outputs}
        for node in list(body.nodes):
            ins = [t for t in node.inputs if not is_absent(t)]
            if (
                node.op not in _INVARIANT_OPS
                or node.domain not in (None, "", "ai.onnx")
                or any(id(t) in made or id(t) in own for t in ins)
                or any(id(o) in outputs for o in node.outputs)
                or any(isinstance(t, gs.Constant) and not _only_reader(body, t, node) for t in ins)
            ):
                continue
            del body.nodes[next(i for i, n in enumerate(body.nodes) if n is node)]
            node.name = editor.unique_name(_claim(editor, node.name or f"{holder.name}/{node.op}"))
            done.append(node.name)
            if _keeps_everything(node):
                editor.redirect(node.outputs[0], node.inputs[0])
                editor.remove_node(node)
            else:
                editor.graph.nodes.append(node)
            changed = True
            break
    return done


def _claim(editor: GraphEditor, name: str) -> str:
    """``name``, freed for a node moving out of a body unless its new graph has a node so named.

    The next :meth:`GraphEditor.unique_name` of it then returns it, or else a suffixed name.
    """
    if not any(n.name == name for n in editor.graph.nodes):
        editor.free(name)
    return name


def _keeps_everything(node: gs.Node) -> bool:
    """``node`` is a Slice returning its input whole (starts 0, steps 1, ends past any length)."""
    if node.op != "Slice" or len(node.inputs) < 3:
        return False
    parts = [constant_value(t) if not is_absent(t) else None for t in node.inputs[1:]]
    starts, ends = parts[0], parts[1]
    steps = parts[3] if len(parts) > 3 else None
    if starts is None or ends is None:
        return False
    if len(node.inputs) > 4 and not is_absent(node.inputs[4]) and steps is None:
        return False
    return (
        bool(np.all(starts == 0))
        and bool(np.all(ends >= 2**31 - 1))
        and (steps is None or bool(np.all(steps == 1)))
    )


def _all_names(graph: gs.Graph) -> set[str]:
    """Every tensor and node name of ``graph`` and its bodies (names are unique model-wide)."""
    names: set[str] = set()
    for node in graph.nodes:
        names.add(node.name)
        names.update(t.name for t in (*node.inputs, *node.outputs))
        for value in node.attrs.values():
            if isinstance(value, gs.Graph):
                names |= _all_names(value)
                names.update(t.name for t in (*value.inputs, *value.outputs))
    return names


def _weight(
    editor: GraphEditor, body: gs.Graph, mm: gs.Node
) -> tuple[gs.Constant, gs.Constant | None] | None:
    """(W, bias or None) with ``mm(x) = x·W (+ bias)``, when only ``mm`` reads them in ``body``.

    A MatMul by a constant 2-D matrix, or a Gemm (how a framework writes a Linear layer on a
    2-D input) by a constant B and constant C (a vector or a scalar), its transB, alpha and
    beta folded into new constants.
    """
    w = mm.inputs[1] if len(mm.inputs) > 1 else None
    if not isinstance(w, gs.Constant) or np.ndim(w.values) != 2 or not _only_reader(body, w, mm):
        return None
    if mm.op == "MatMul":
        return w, None
    if int(mm.attrs.get("transA", 0)):
        return None
    c = mm.inputs[2] if len(mm.inputs) > 2 and not is_absent(mm.inputs[2]) else None
    bias = None
    if c is not None:
        value = constant_value(c)
        if value is None or value.size not in (1, value.shape[-1]) or value.ndim > 2:
            return None  # a C that differs row by row is not a bias
        if not _only_reader(body, c, mm):
            return None
        beta = float(mm.attrs.get("beta", 1.0))
        bias = editor.constant(f"{mm.name}.bias", (value.reshape(-1) * beta).astype(value.dtype))
    alpha = float(mm.attrs.get("alpha", 1.0))
    if not int(mm.attrs.get("transB", 0)) and alpha == 1.0:
        return w, bias
    value = np.asarray(w.values)
    value = value.T if int(mm.attrs.get("transB", 0)) else value
    return editor.constant(f"{mm.name}.weight", (value * alpha).astype(value.dtype)), bias


def _holds(body: gs.Graph, node: gs.Node) -> bool:
    """``node`` is one of ``body``'s own nodes (graphsurgeon's ``in`` compares, not identifies)."""
    return any(n is node for n in body.nodes)


def _only_reader(body: gs.Graph, tensor: gs.Tensor, node: gs.Node) -> bool:
    """No node of ``body`` but ``node`` reads ``tensor``."""
    return all(n is node for n in body.nodes if any(t is tensor for t in n.inputs))


def _bias_after(body: gs.Graph, mm: gs.Node) -> tuple[gs.Node | None, gs.Node | None]:
    """The ``Add`` of a constant bias (a vector or a scalar) after ``mm``: (it, the sum between).

    Either it alone reads ``mm``'s result (``Add(x_t·W, b)``; no sum between), or ``mm``'s
    result is added to another value first and only the bias reads that sum
    (``Add(Add(x_t·W, h·U), b)``, how an LSTM step is often written): the bias then joins the
    hoisted product, the sum reading it (the float additions in another order).
    """
    y = mm.outputs[0]
    add = _sole_reader(body, y)
    if add is None or add.op != "Add":
        return None, None
    if _constant_operand(body, add, y) is not None:
        return add, None
    s = add.outputs[0]
    bias = _sole_reader(body, s)
    if bias is None or bias.op != "Add" or _constant_operand(body, bias, s) is None:
        return None, None
    return bias, add


def _sole_reader(body: gs.Graph, y: gs.Tensor) -> gs.Node | None:
    """The one node of ``body`` reading ``y``, when ``y`` is not also a body output."""
    readers = [n for n in body.nodes if any(t is y for t in n.inputs)]
    if len(readers) != 1 or any(t is y for t in body.outputs):
        return None
    return readers[0]


def _constant_operand(body: gs.Graph, add: gs.Node, y: gs.Tensor) -> gs.Tensor | None:
    """``add``'s operand beside ``y`` when it is a constant vector or scalar only it reads."""
    other = add.inputs[1] if add.inputs[0] is y else add.inputs[0]
    value = constant_value(other)
    if value is None or value.ndim > 1 or not _only_reader(body, other, add):
        return None
    return other


def _project(
    editor: GraphEditor,
    mm: gs.Node,
    weights: tuple[gs.Constant, gs.Constant | None],
    x: gs.Tensor,
    steps: tuple[int, int],
    body: gs.Graph,
) -> tuple[gs.Variable, gs.Variable]:
    """Add ``MatMul(x, w)`` (+ its bias) to the outer graph; (its output, the body's result).

    ``steps``: (axis of ``x`` the loop steps along, rank of ``x``). The output has the steps
    on axis 0: the loop then reads each step's rows as one block (onnxruntime's Scan would
    otherwise transpose the whole product before its first step; a Gather along axis 1 copies
    each step's rows apart), and ``x`` is transposed instead, the smaller of the two.
    """
    bias, via = _bias_after(body, mm)
    result = bias.outputs[0] if bias is not None and via is None else mm.outputs[0]
    for n in (mm, bias):  # the nodes leave the body: the outer ones take their names
        if n is not None:
            _claim(editor, n.name)
    axis, rank = steps
    if axis != 0:  # one Transpose for every projection of the same input
        perm = [axis] + [d for d in range(rank) if d != axis]
        done = [
            n
            for n in x.outputs
            if n.op == "Transpose"
            and list(n.attrs.get("perm", [])) == perm
            and _holds(editor.graph, n)
        ]
        if done:
            x = done[0].outputs[0]
        else:
            first = editor.variable(f"{x.name}_steps_first", x.dtype)
            editor.add_node("Transpose", [x], [first], f"{mm.name}_steps_first", {"perm": perm})
            x = first
    w, c = weights
    product = editor.variable(f"{mm.outputs[0].name}_all_steps", x.dtype)
    editor.add_node("MatMul", [x, w], [product], mm.name)
    if c is not None:  # a Gemm's own bias
        biased = editor.variable(f"{mm.outputs[0].name}_all_steps", x.dtype)
        editor.add_node("Add", [product, c], [biased], f"{mm.name}_bias")
        product = biased
    out = product
    if bias is not None:
        summed = via.outputs[0] if via is not None else mm.outputs[0]
        b = bias.inputs[1] if bias.inputs[0] is summed else bias.inputs[0]
        out = editor.variable(f"{bias.outputs[0].name}_all_steps", x.dtype)
        editor.add_node("Add", [product, b], [out], bias.name)
        if via is not None:  # the sum writes what the bias Add wrote
            editor.absorb(via, bias)
        else:
            editor.remove_node(bias)
    editor.remove_node(mm)
    result.dtype = result.dtype or x.dtype
    return out, result


def _hoist_scan(editor: GraphEditor, scan: gs.Node, body: gs.Graph, mm: gs.Node) -> bool:
    """Hoist ``mm = MatMul(x_t, W)`` (or a Gemm) of a Scan body whose ``x_t`` is a scan input."""
    scans = int(scan.attrs.get("num_scan_inputs", 0))
    states = len(scan.inputs) - scans
    x_t = mm.inputs[0]
    own = body.inputs[states:]
    if not any(x_t is t for t in own) or len(body.inputs) != len(scan.inputs):
        return False
    k = next(i for i, t in enumerate(own) if t is x_t)
    rank = len(x_t.shape) if x_t.shape is not None else None
    axes = list(scan.attrs.get("scan_input_axes", [0] * scans))
    directions = list(scan.attrs.get("scan_input_directions", [0] * scans))
    if rank is None:
        return False
    axis = int(axes[k]) + (rank + 1 if int(axes[k]) < 0 else 0)
    if not 0 <= axis < rank:
        return False  # the scan axis must not be the last one, which the MatMul sums over
    weights = _weight(editor, body, mm)
    if weights is None:
        return False
    outer = scan.inputs[states + k]
    projected, result = _project(editor, mm, weights, outer, (axis, rank + 1), body)
    result.shape = None
    body.inputs.append(result)
    scan.inputs.append(projected)
    axes.append(0)
    directions.append(int(directions[k]))
    if not any(any(t is x_t for t in n.inputs) for n in body.nodes):
        del body.inputs[states + k], scan.inputs[states + k], axes[k], directions[k]
    else:
        scans += 1
    scan.attrs["num_scan_inputs"] = scans
    scan.attrs["scan_input_axes"] = axes
    scan.attrs["scan_input_directions"] = directions
    return True


def _hoist_loop(editor: GraphEditor, loop: gs.Node, body: gs.Graph, mm: gs.Node) -> bool:
    """Hoist ``mm = MatMul(Gather(X, i), W)`` (or a Gemm) of a Loop body, ``i`` its counter."""
    gather = producer(mm.inputs[0])
    if gather is None or gather.op != "Gather" or not _holds(body, gather) or not body.inputs:
        return False
    x, index = gather.inputs[0], gather.inputs[1]
    if index is not body.inputs[0] or not isinstance(x, gs.Variable) or x.shape is None:
        return False
    made = producer(x)
    if (made is not None and _holds(body, made)) or any(x is t for t in body.inputs):
        return False  # X must come from outside the body
    rank = len(x.shape)
    axis = int(gather.attrs.get("axis", 0))
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank - 1 or not loop.inputs or not _counts_rows(loop.inputs[0], x, axis):
        return False  # the loop may run fewer steps than X has rows: no product for nothing
    weights = _weight(editor, body, mm)
    if weights is None:
        return False
    projected, result = _project(editor, mm, weights, x, (axis, rank), body)
    row = GraphEditor(body)
    row.reserve(editor.names())
    row.add_node("Gather", [projected, index], [result], f"{gather.name}_projected", {"axis": 0})
    editor.reserve(row.names())
    return True


#: ops that pass a count through unchanged (a scalar made a vector, cast to int64, ...)
_SAME_COUNT = ("Cast", "Squeeze", "Unsqueeze", "Reshape", "Identity")


def _counts_rows(trips: gs.Tensor, x: gs.Tensor, axis: int) -> bool:
    """The trip count ``trips`` is the length of ``x`` along ``axis``.

    Either both are known numbers, or the count is read from ``x``'s shape
    (``Gather(Shape(x), axis)``, or ``Shape(x, start=axis, end=axis + 1)``, through casts and
    reshapes): how a framework writes ``for t in range(x.size(1))``.
    """
    if is_absent(trips):
        return False
    value = constant_value(trips)
    if value is not None:
        return (
            value.size == 1 and x.shape is not None and x.shape[axis] == int(value.reshape(-1)[0])
        )
    node = producer(trips)
    while node is not None and node.op in _SAME_COUNT and node.inputs:
        node = producer(node.inputs[0])
    if node is None:
        return False
    rank = len(x.shape) if x.shape is not None else None
    if node.op == "Shape" and node.inputs[0] is x and rank is not None:
        start = int(node.attrs.get("start", 0))
        end = node.attrs.get("end")
        start = start + rank if start < 0 else start
        end = (int(end) + rank if int(end) < 0 else int(end)) if end is not None else rank
        return start == axis and end == axis + 1
    if node.op != "Gather" or int(node.attrs.get("axis", 0)) != 0 or len(node.inputs) < 2:
        return False
    shape, index = producer(node.inputs[0]), constant_value(node.inputs[1])
    if shape is None or shape.op != "Shape" or shape.inputs[0] is not x or index is None:
        return False
    if index.size != 1 or rank is None or int(shape.attrs.get("start", 0)) != 0:
        return False
    i = int(index.reshape(-1)[0])
    return (i + rank if i < 0 else i) == axis
