"""Per-node configuration from a TOML file (``--config``).

Priority, lowest first: the global keys < ``[op_type.<Op>]`` < each matching ``[[node_regex]]``
entry in file order < ``[node."<name>"]``, key by key; a group rewritten together (a Conv
and its folded Relu) takes each key from its most specific entry. Keys at every level:

| key | meaning |
|---|---|
| ``keep_float`` | true: leave the node float (like ``--exclude``) |
| ``method`` | calibration method of the patterns rooted at the node (``minmax``, ``entropy``, …) |
| ``activation_dtype`` | ``uint8``, ``int8`` or ``int16`` (int16: QDQ output only, opset 21) |
| ``weight_dtype`` | ``int8``, or ``int4`` (MatMul/Gemm: block-wise weights, float activations) |
| ``per_channel`` | true/false: per-channel weight scales for the node's pattern |

A setting the target cannot run (int16 in QOperator, int4 on a Conv, …) is ignored for that
node with a warning and the reason in ``inspect --explain``.

Example::

    method = "minmax"

    [op_type.Gemm]
    method = "percentile"

    [[node_regex]]
    pattern = "^head/"
    keep_float = true

    [node."conv1"]
    method = "entropy"
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from typing import Any

from onnxq.calibrators import METHODS
from onnxq.core.errors import ConfigError
from onnxq.io.text import shown

KEYS = {"keep_float", "method", "activation_dtype", "weight_dtype", "per_channel"}
ACTIVATION_DTYPES = ("uint8", "int8", "int16")
WEIGHT_DTYPES = ("int8", "int4")


def load_toml(path: str | os.PathLike[str], option: str) -> dict[str, Any]:
    """A TOML file as a dict; a missing or malformed file is a ConfigError naming ``option``."""
    import tomllib

    where = f"{option} file '{shown(str(path))}'"
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{where} is a folder; pass a .toml file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where} is not valid TOML: {shown(str(exc))}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where} is not text (TOML is UTF-8); pass a .toml file") from None
    except RecursionError:
        raise ConfigError(
            f"{where} nests arrays or tables deeper than onnxq reads; a config needs two levels"
        ) from None


def _value(value: Any) -> str:
    """A value from the file as a message shows it (quoted, escaped, cut)."""
    return shown(repr(value), 80)


def most_specific(nodes: list[str], values: dict[str, Any], levels: dict[str, int]) -> Any:
    """The setting of ``nodes`` (one group) from the highest priority level, first on ties.

    ``values``/``levels``: per node, its setting and the level that set it; None when no
    node of the group has one.
    """
    set_ = [n for n in nodes if n in values]
    if not set_:
        return None
    return values[max(set_, key=lambda n: levels.get(n, 0))]


@dataclass(frozen=True)
class NodeSettings:
    """The resolved settings of one node and where each came from."""

    keep_float: bool = False
    method: str | None = None
    #: the most specific layer that set anything for the node
    source: str = "defaults"
    activation_dtype: str | None = None
    weight_dtype: str | None = None
    per_channel: bool | None = None
    #: per key: the priority level of the layer that set it (global 0, op type 1, regex 2,
    #: name 3) and that layer's name; a key no layer sets is absent
    levels: dict[str, int] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def level(self, key: str) -> int:
        """The priority level that set ``key`` (−1: unset)."""
        return self.levels.get(key, -1)


@dataclass
class UserConfig:
    """Parsed configuration; :meth:`resolve` applies the priority rules."""

    global_: dict[str, Any] = field(default_factory=dict)
    op_type: dict[str, dict[str, Any]] = field(default_factory=dict)
    node_regex: list[tuple[re.Pattern[str], dict[str, Any]]] = field(default_factory=list)
    node: dict[str, dict[str, Any]] = field(default_factory=dict)
    path: str = "the configuration"

    @staticmethod
    def load(path: str | os.PathLike[str]) -> UserConfig:
        """Read and validate a TOML file."""
        return UserConfig.from_dict(load_toml(path, "--config"), str(path))

    @staticmethod
    def from_dict(doc: dict[str, Any], path: str = "the configuration") -> UserConfig:
        """Validate a parsed document."""
        cfg = UserConfig(path=f"'{path}'")

        def settings(where: str, table: Any, extra: frozenset[str] = frozenset()) -> dict[str, Any]:
            at = f" (in {where})" if where else ""
            if not isinstance(table, dict):
                raise ConfigError(f"{cfg.path}: {where} must be a table of settings")
            unknown = set(table) - KEYS - extra
            if unknown:
                raise ConfigError(
                    f"{cfg.path}: unknown key(s) {shown(str(sorted(unknown)))}{at}; the keys "
                    f"are {', '.join(sorted(KEYS))}"
                )
            for flag in ("keep_float", "per_channel"):
                if flag in table and not isinstance(table[flag], bool):
                    raise ConfigError(
                        f"{cfg.path}: {flag} = {_value(table[flag])}{at} must be true or false"
                    )
            for key, allowed in (
                ("activation_dtype", ACTIVATION_DTYPES),
                ("weight_dtype", WEIGHT_DTYPES),
                ("method", METHODS),
            ):
                if key in table and table[key] not in allowed:
                    raise ConfigError(
                        f"{cfg.path}: {key} = {_value(table[key])}{at} is not one of "
                        f"{', '.join(allowed)}"
                    )
            return {k: v for k, v in table.items() if k in KEYS}

        sections = {"op_type", "node_regex", "node"}
        cfg.global_ = settings("", {k: v for k, v in doc.items() if k not in sections})
        examples = {"op_type": "[op_type.Conv]", "node": '[node."conv1"]'}
        for section, example in examples.items():
            if not isinstance(doc.get(section, {}), dict):
                raise ConfigError(
                    f"{cfg.path}: {section} = {_value(doc[section])} must be tables of "
                    f"settings instead, e.g. {example} with keep_float = true on the next line"
                )
        for op, table in doc.get("op_type", {}).items():
            cfg.op_type[op] = settings(f"[op_type.{shown(op)}]", table)
        regexes = doc.get("node_regex", [])
        if not isinstance(regexes, list):
            raise ConfigError(f"{cfg.path}: node_regex must be an array of tables ([[node_regex]])")
        for i, table in enumerate(regexes):
            where = f"[[node_regex]] #{i + 1}"
            if not isinstance(table, dict) or not isinstance(table.get("pattern"), str):
                raise ConfigError(f'{cfg.path}: {where} needs a pattern = "regex"')
            try:
                rx = re.compile(table["pattern"])
            except (re.error, RecursionError, OverflowError) as exc:
                raise ConfigError(
                    f"{cfg.path}: {where} pattern {_value(table['pattern'])} is not a "
                    f"valid regular expression ({shown(str(exc))})"
                ) from None
            cfg.node_regex.append((rx, settings(where, table, frozenset({"pattern"}))))
        for name, table in doc.get("node", {}).items():
            cfg.node[name] = settings(f'[node."{shown(name)}"]', table)
        return cfg

    def with_nodes(self, entries: dict[str, dict[str, Any]]) -> UserConfig:
        """A copy with ``entries`` set in the ``[node."…"]`` tables (over what they held)."""
        nodes = {name: dict(table) for name, table in self.node.items()}
        for name, table in entries.items():
            nodes[name] = {**nodes.get(name, {}), **table}
        return replace(self, node=nodes)

    def resolve(self, node: str, op: str) -> NodeSettings:
        """The settings of ``node`` (an op of type ``op``) after applying the priorities."""
        out = NodeSettings()
        layers: list[tuple[int, str, dict[str, Any]]] = [(0, "global", self.global_)]
        if op in self.op_type:
            layers.append((1, f"[op_type.{op}]", self.op_type[op]))
        layers += [
            (2, f"node_regex {rx.pattern!r}", t) for rx, t in self.node_regex if rx.search(node)
        ]
        if node in self.node:
            layers.append((3, f'[node."{node}"]', self.node[node]))
        levels: dict[str, int] = {}
        sources: dict[str, str] = {}
        for level, source, table in layers:
            if table:
                out = replace(out, **table, source=source)
                levels.update(dict.fromkeys(table, level))
                sources.update(dict.fromkeys(table, source))
        return replace(out, levels=levels, sources=sources)

    def asks(self, key: str, value: Any) -> bool:
        """Some level of the configuration sets ``key`` to ``value`` (opset decisions)."""
        tables = [self.global_, *self.op_type.values(), *(t for _, t in self.node_regex)]
        return any(t.get(key) == value for t in [*tables, *self.node.values()])

    def unknown_nodes(self, names: set[str]) -> list[str]:
        """``[node."…"]`` entries naming no node of the model."""
        return sorted(n for n in self.node if n not in names)

    def unknown_op_types(self, ops: set[str]) -> list[str]:
        """``[op_type.…]`` entries naming an op type the model does not have."""
        return sorted(op for op in self.op_type if op not in ops)
