"""The chart's ``values.schema.json`` and the parameter table of its README, from ``values.yaml``.

``values.yaml`` documents every value with a ``## @param path text`` line (Bitnami's readme-generator
convention). A value is an object that the schema closes (an unknown key fails ``helm lint``) when a
``@param`` names a path below it; otherwise (``resources``, ``nodeSelector``, ``extraEnv``...) its
content is free. Types come from the defaults: a wrong type (``workers.replicas: "four"``) fails too.
A ``## @schema path {json}`` line adds JSON-schema keywords to a value (a range, an ``enum``, a
``pattern``); every number must have its range (``minimum`` or ``exclusiveMinimum``), or the schema is
not written. Pure: PyYAML only.
"""
from __future__ import annotations

import json
import re
from typing import Any

import yaml

PARAM = re.compile(r"^\s*## @param (\S+) (.*)$")
SCHEMA = re.compile(r"^\s*## @schema (\S+) (.*)$")
NUMBERS = ("Mbps", "Mib", "Kib", "S")  # integer defaults of values that may be fractional (S: seconds)
PARAMS_BEGIN, PARAMS_END = "<!-- @params begin -->", "<!-- @params end -->"


def params(values_text: str) -> dict[str, str]:
    """path -> description, in file order."""
    return {m.group(1): m.group(2).strip() for m in map(PARAM.match, values_text.splitlines()) if m}


def constraints(values_text: str) -> dict[str, dict[str, Any]]:
    """path -> the JSON-schema keywords its ``@schema`` line adds."""
    found = {}
    for match in filter(None, map(SCHEMA.match, values_text.splitlines())):
        keywords = json.loads(match.group(2))
        if not isinstance(keywords, dict):
            raise ValueError(f"@schema {match.group(1)}: expected a JSON object, got {match.group(2)}")
        found[match.group(1)] = keywords
    return found


def _type_of(path: str, value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"type": "boolean"}
    if isinstance(value, int):
        return {"type": "number" if path.endswith(NUMBERS) else "integer"}
    if isinstance(value, float):
        return {"type": "number"}
    if isinstance(value, str):
        return {"type": "string"}
    if isinstance(value, list):
        return {"type": "array"}
    return {"type": "object"}


def _schema(path: str, value: Any, described: dict[str, str], limits: dict[str, dict[str, Any]]) -> dict[str, Any]:
    schema = _type_of(path, value) | limits.get(path, {})
    if schema["type"] in ("integer", "number") and not {"minimum", "exclusiveMinimum"} & set(schema):
        raise ValueError(f"{path}: a number without its range: add ## @schema {path} {{\"minimum\": ...}}")
    if path in described:
        schema["description"] = described[path]
    closed = isinstance(value, dict) and any(p.startswith(f"{path}." if path else "") for p in described if p != path)
    if closed:
        schema["properties"] = {key: _schema(f"{path}.{key}" if path else key, child, described, limits)
                                for key, child in value.items()}
        schema["additionalProperties"] = False
    return schema


def values_schema(values_text: str) -> str:
    described, limits = params(values_text), constraints(values_text)
    unknown = set(limits) - set(described)
    if unknown:
        raise ValueError(f"@schema of values without a @param: {sorted(unknown)}")
    schema = {"$schema": "https://json-schema.org/draft-07/schema#", "title": "IMerge chart values",
              **_schema("", yaml.safe_load(values_text), described, limits)}
    schema["properties"]["global"] = {"type": "object", "description": "Values shared with subcharts (Helm)"}
    return json.dumps(schema, indent=2) + "\n"


def params_table(values_text: str) -> str:
    values = yaml.safe_load(values_text)
    rows = ["| value | default | what it does |", "|---|---|---|"]
    for path, text in params(values_text).items():
        default: Any = values
        for key in path.split("."):
            default = default.get(key) if isinstance(default, dict) else None
        shown = json.dumps(default) if not isinstance(default, str) else f'"{default}"'
        rows.append(f"| `{path}` | `{shown}` | {text.replace('|', '/')} |")
    return "\n".join(rows) + "\n"


def readme_with_params(readme: str, values_text: str) -> str:
    """The README with its generated parameter table (between the markers) brought up to date."""
    begin, end = readme.index(PARAMS_BEGIN) + len(PARAMS_BEGIN), readme.index(PARAMS_END)
    return readme[:begin] + "\n" + params_table(values_text) + readme[end:]
