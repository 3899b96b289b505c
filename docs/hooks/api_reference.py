"""The API reference pages, generated from the app's own OpenAPI document each time the site is built.

An MkDocs hook: it builds the app (in memory, serving nothing), reads `/api/openapi.json` from it as a client would,
and writes one page per tag (`reference/<tag>-api.md`: each operation, its parameters, body and answers, then every
schema those reach) and the document itself (`reference/openapi.json`). So the reference cannot drift from the code,
and a route or model that changes shows up in the next strict build.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

METHODS = ("get", "post", "put", "patch", "delete")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    document = openapi(Path(config.config_file_path).parent)
    files.append(File.generated(config, "reference/openapi.json", content=json.dumps(document, indent=2)))
    for tag, operations in by_tag(document).items():
        page = tag_page(tag, operations, document)
        files.append(File.generated(config, f"reference/{tag}-api.md", content=page))
    return files


def openapi(root: Path) -> dict[str, Any]:
    """The document the app serves, from this checkout's code (not whichever copy is installed)."""
    sys.path.insert(0, str(root))
    from starlette.testclient import TestClient

    from proxy.app import create_app
    from proxy.settings import Settings

    app = create_app(Settings(database_url="sqlite:///:memory:", trainer_token="docs"))
    document = TestClient(app).get("/api/openapi.json").raise_for_status().json()
    assert isinstance(document, dict)
    return document


def by_tag(document: dict[str, Any]) -> dict[str, list[tuple[str, str, dict[str, Any]]]]:
    """Each tag's operations (method, path, operation), in the document's order."""
    tags: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for path, item in document["paths"].items():
        for method in METHODS:
            if (operation := item.get(method)) is not None:
                for tag in operation.get("tags") or ["other"]:
                    tags.setdefault(tag, []).append((method, path, operation))
    return tags


def tag_page(tag: str, operations: list[tuple[str, str, dict[str, Any]]], document: dict[str, Any]) -> str:
    info = document["info"]
    lines = [
        f"# The {tag} API: reference",
        "",
        f"Generated from the OpenAPI {document['openapi']} document that trajproxy {info['version']} serves at "
        "`/api/openapi.json` (and reads in Swagger UI at `/api/docs`); the document itself is "
        "[openapi.json](openapi.json). Every call takes the trainer token as `Authorization: Bearer …` and a JSON "
        "body as `Content-Type: application/json`. The guide: [the trainer API](../trainer-api.md).",
        "",
    ]
    for method, path, operation in operations:
        lines += operation_section(method, path, operation)
    lines += ["## Schemas", ""]
    schemas = document.get("components", {}).get("schemas", {})
    for name in reachable([operation for _, _, operation in operations], schemas):
        lines += schema_section(name, schemas[name])
    return "\n".join(lines)


def operation_section(method: str, path: str, operation: dict[str, Any]) -> list[str]:
    lines = [f"## `{method.upper()} {path}`", ""]
    if summary := operation.get("summary"):
        lines += [f"**{summary}.**", ""]
    if description := operation.get("description"):
        lines += [description.strip(), ""]
    parameters = operation.get("parameters") or []
    if parameters:
        lines += ["| parameter | in | type | required | description |", "|---|---|---|---|---|"]
        for parameter in parameters:
            lines.append(
                row(
                    f"`{parameter['name']}`",
                    parameter["in"],
                    type_of(parameter.get("schema", {})),
                    "yes" if parameter.get("required") else "",
                    described(parameter.get("description"), parameter.get("schema", {})),
                )
            )
        lines.append("")
    if body := operation.get("requestBody"):
        for media, content in body.get("content", {}).items():
            lines += [f"Body (`{media}`): {type_of(content.get('schema', {}))}", ""]
    lines += ["| status | answer |", "|---|---|"]
    for status, response in operation.get("responses", {}).items():
        shapes = [type_of(content.get("schema", {})) for content in response.get("content", {}).values()]
        lines.append(row(status, "; ".join([response.get("description", ""), *shapes])))
    return [*lines, ""]


def schema_section(name: str, schema: dict[str, Any]) -> list[str]:
    lines = [f"### {name} {{#{name}}}", ""]
    if description := schema.get("description"):
        lines += [description.strip(), ""]
    if "enum" in schema:
        lines += ["One of " + ", ".join(f"`{json.dumps(value)}`" for value in schema["enum"]) + ".", ""]
    properties = schema.get("properties", {})
    if properties:
        required = set(schema.get("required", ()))
        lines += ["| field | type | required | default | description |", "|---|---|---|---|---|"]
        for field, spec in properties.items():
            default = f"`{json.dumps(spec['default'])}`" if "default" in spec else ""
            lines.append(
                row(f"`{field}`", type_of(spec), "yes" if field in required else "", default, spec.get("description"))
            )
        lines.append("")
    return lines


def described(description: str | None, schema: dict[str, Any]) -> str:
    """A parameter's description and its default, whichever it has."""
    said = description or schema.get("description") or ""
    if "default" in schema:
        said = f"{said} (default `{json.dumps(schema['default'])}`)".strip()
    return said


def type_of(schema: dict[str, Any]) -> str:
    """A schema's type in a few words, each referenced schema linked to its section."""
    if ref := schema.get("$ref"):
        name = ref.rsplit("/", 1)[-1]
        return f"[`{name}`](#{name})"
    for union in ("anyOf", "oneOf"):
        if union in schema:
            return " or ".join(type_of(option) for option in schema[union])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return " or ".join(f"`{json.dumps(value)}`" for value in schema["enum"])
    kind = schema.get("type")
    if kind == "array":
        return f"array of {type_of(schema.get('items', {}))}"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"object of {type_of(schema['additionalProperties'])}"
    if isinstance(kind, list):
        return " or ".join(f"`{one}`" for one in kind)
    return f"`{kind}`" if kind else "any"


def reachable(operations: list[dict[str, Any]], schemas: dict[str, Any]) -> list[str]:
    """The names of the schemas the operations reference, directly or through other schemas, sorted."""
    seen: set[str] = set()
    pending = [ref for operation in operations for ref in refs(operation)]
    while pending:
        name = pending.pop()
        if name not in seen and name in schemas:
            seen.add(name)
            pending += refs(schemas[name])
    return sorted(seen)


def refs(value: object) -> Iterator[str]:
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "$ref" and isinstance(item, str):
                yield item.rsplit("/", 1)[-1]
            else:
                yield from refs(item)
    elif isinstance(value, list):
        for item in value:
            yield from refs(item)


def row(*cells: object) -> str:
    """A table row; a cell's pipes and line breaks would end it early."""
    text = [" ".join(str(cell or "").split()).replace("|", "\\|") for cell in cells]
    return "| " + " | ".join(text) + " |"
