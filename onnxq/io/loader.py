"""``module:attribute`` references from the command line (``--data``, ``--callback``)."""

from __future__ import annotations

import importlib
import os
import re
import sys
from typing import Any

from onnxq.core.errors import ConfigError

_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def is_reference(text: str) -> bool:
    """True for ``package.module:attribute`` that is not an existing path."""
    return bool(_REF.match(text)) and not os.path.exists(text)


def load_object(ref: str, option: str) -> Any:
    """Import ``module`` (the current directory first on the path) and return ``attribute``."""
    if not _REF.match(ref):
        raise ConfigError(f"{option} {ref!r} is not module:attribute (e.g. mydata:calibration)")
    module_name, attr = ref.split(":", 1)
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{option} {ref!r}: cannot import module '{module_name}' ({exc}); make "
            "it importable from the current directory or install it"
        ) from None
    except Exception as exc:  # the user's module failed while importing
        raise ConfigError(
            f"{option} {ref!r}: importing '{module_name}' raised {type(exc).__name__}: {exc}"
        ) from None
    finally:
        sys.path.remove(os.getcwd())
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{option} {ref!r}: module '{module_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    return obj
