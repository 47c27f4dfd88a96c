"""The served OpenAPI schema: every route, with the JSON body each one validates.

Routes read their bodies themselves (`parse_body`) so that every error is a 400 naming the field;
FastAPI therefore cannot see the body models. A route declares its body with
`openapi_extra=json_body(Model)`, and `install_openapi` serves `/openapi.json` with those schemas
(their nested models under `components.schemas`). Client generators and API fuzzers read it; a test
checks that every route of the app appears in it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_DEFS_KEY = "x-tide-defs"
_REF_TEMPLATE = "#/components/schemas/{model}"


def json_body(model: type[BaseModel], required: bool = True) -> dict[str, Any]:
    """`openapi_extra` for a route whose body is `model` as `application/json`."""
    schema = model.model_json_schema(ref_template=_REF_TEMPLATE)
    defs = schema.pop("$defs", {})
    return {
        "requestBody": {"required": required,
                        "content": {"application/json": {"schema": schema}}},
        _DEFS_KEY: defs,
    }


def install_openapi(app: FastAPI) -> None:
    """Serve `/openapi.json` built from the app's routes and their `json_body` declarations."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                              description=app.description)
            components = doc.setdefault("components", {}).setdefault("schemas", {})
            for operations in doc.get("paths", {}).values():
                for operation in operations.values():
                    components.update(operation.pop(_DEFS_KEY, {}))
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
