"""What /openapi.json says beyond what FastAPI infers: every error status a route can answer with
OpenAI's error object, the streamed forms of the generation routes, and no 422 (a body that does
not validate is a 400, as OpenAI answers)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from roseinfer.server.protocol import ErrorResponse

_ERRORS = {
    400: "The request is invalid (a field out of range, a prompt that does not fit the context, one of "
         "this server's request limits exceeded); `param` names the field.",
    401: "The API key is missing or wrong (a server started with --api-key).",
    404: "The model named is not served here.",
    408: "The request ran past this server's time limit per request (--request-timeout).",
    413: "The request body is larger than this server's limit (--max-request-body-bytes).",
    500: "The engine step that ran the request failed.",
    503: "The server is overloaded (more requests waiting than --max-queue-len) or shutting down; "
         "retry after the seconds in Retry-After.",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying (when overloaded).",
                                "schema": {"type": "integer"}}}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries of a route for these error statuses."""
    return {
        status: {"model": ErrorResponse, "description": _ERRORS[status]} | ({"headers": _RETRY_AFTER} if status == 503 else {})
        for status in statuses
    }


def streamed(model: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The 200 response of a route that answers whole (JSON) or, with `stream: true`, as
    server-sent events: `data: <chunk JSON>` with what was generated since the last one (an
    ErrorResponse if the request fails after the stream has started), ending with `data: [DONE]`.
    The event-stream schema describes one event (before Open API 3.2's itemSchema, the convention
    schemathesis checks streams by)."""
    event = {
        "type": "object", "required": ["data"],
        "properties": {"data": {"anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [
                {"$ref": f"#/components/schemas/{chunk.__name__}"}, {"$ref": "#/components/schemas/ErrorResponse"},
            ]}},
        ]}},
    }
    description = (f"The whole response; with `stream: true`, server-sent events: `data: <{chunk.__name__}>` "
                   "with what was generated since the last event (an ErrorResponse if the request fails "
                   "after the stream has started), ending with `data: [DONE]`.")
    return {200: {"model": model, "description": description, "content": {"text/event-stream": {"schema": event}}}}


def finish_document(app: FastAPI, extra_models: list[type[BaseModel]]) -> None:
    """Make /openapi.json drop FastAPI's 422 responses and their schemas, and hold the schemas of
    `extra_models` (what only a stream sends) as components."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for path_item in schema.get("paths", {}).values():
                for operation in path_item.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            for model in extra_models:
                extra = model.model_json_schema(ref_template="#/components/schemas/{model}")
                for name, definition in [*extra.pop("$defs", {}).items(), (model.__name__, extra)]:
                    schemas.setdefault(name, definition)
        return app.openapi_schema

    app.openapi = openapi
