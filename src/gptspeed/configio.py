"""Configuration files: reading a ``--config`` file (YAML through PyYAML's safe loader, or JSON) into a
mapping of settings (:func:`read_config_file`), and writing a configuration as the YAML file
``--print-config`` prints (:func:`config_yaml`).

:mod:`gptspeed.config` declares the settings and applies a file's mapping to them; this module only
reads and writes the files (no torch, nothing of gptspeed's but its errors and file helpers).
"""

from __future__ import annotations

import collections.abc
import json
import os
from pathlib import Path
from typing import Any

from gptspeed.errors import GptspeedError, show_value
from gptspeed.fileio import parse_json, read_user_text


class DuplicateKey(Exception):
    """A config file's mapping names ``key`` twice (at ``line``, YAML only)."""

    def __init__(self, key: Any, line: int | None = None):
        super().__init__(key, line)
        self.key, self.line = key, line


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' ``object_pairs_hook``: the object, or DuplicateKey for a key given twice."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise DuplicateKey(key)
        seen[key] = value
    return seen


def _yaml_loader():
    """PyYAML's safe loader, reading ``1e-3`` as a float as YAML 1.2 and JSON do (YAML 1.1, which
    PyYAML implements, wants a dot -- ``1.0e-3`` -- and would make ``1e-3`` a string)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):  # a key twice is refused, not "the last one wins"
            seen = set()
            for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                if isinstance(key, collections.abc.Hashable):
                    if key in seen:
                        raise DuplicateKey(key, key_node.start_mark.line + 1)
                    seen.add(key)
            return super().construct_mapping(node, deep)

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
    )
    return Loader


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a config file: JSON for a ``.json`` file, YAML (PyYAML, safe loading) for
    any other (``.yaml``, ``.yml``, ...). Raises GptspeedError (one line, with the line and column
    of a syntax error) when the file cannot be read -- missing, a folder, a FIFO or a device
    (``/dev/zero``), too large, not UTF-8 (:func:`gptspeed.fileio.read_user_text`) --, does not
    parse, is nested too deeply to parse, names a key twice in one mapping (PyYAML and ``json``
    would keep the last silently), or is not a mapping. A ``~`` in ``path`` is expanded."""
    path = Path(os.path.expanduser(str(path)))
    kind = "JSON" if path.suffix.lower() == ".json" else "YAML"
    text = read_user_text(path, "config file")
    try:
        if kind == "JSON":
            raw = parse_json(text, f"config file {path}", expect=None)
            json.loads(text, object_pairs_hook=_no_duplicate_keys)  # parsed: now the keys given twice
        else:
            raw = _read_yaml(text, path)
    except DuplicateKey as e:
        where = f" (line {e.line})" if e.line else ""
        raise GptspeedError(f"config file {path}: {show_value(e.key)} is given twice{where}: keep one"[:300]) from None
    if not isinstance(raw, dict):
        raise GptspeedError(
            f"config file {path}: expected a {'JSON object' if kind == 'JSON' else 'YAML mapping'} "
            f"of settings, got {type(raw).__name__}"
        )
    return raw


def _read_yaml(text: str, path: Path) -> Any:
    """:func:`read_config_file`'s YAML: PyYAML's safe loading (:func:`_yaml_loader`), its errors one line."""
    import yaml

    try:
        return yaml.load(text, Loader=_yaml_loader())  # noqa: S506 -- a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        what = " ".join(str(getattr(e, "problem", None) or e).split())
        raise GptspeedError(f"config file {path} is not valid YAML: {what}{where}"[:300]) from None
    except RecursionError:
        raise GptspeedError(f"config file {path} is nested too deeply to be read") from None
    except (ValueError, OverflowError) as e:  # a value PyYAML's constructors cannot make (an int of 5,000 digits)
        what = " ".join(str(e).split())
        raise GptspeedError(f"config file {path} is not valid YAML: {what}"[:300]) from None


def config_yaml(doc: dict[str, Any]) -> str:
    """The YAML file of a configuration ``doc`` (nested by group under its preset's name, as
    :func:`gptspeed.config.config_to_yaml` builds it): a two-line header saying how to run it, then
    ``doc`` in its order."""
    import yaml

    return (
        "# gptspeed train configuration (every setting; `gptspeed train --help` says what each does).\n"
        "# Run it with: gptspeed train --config THIS_FILE  (flags given as well override it)\n"
        + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, allow_unicode=True)
    )
