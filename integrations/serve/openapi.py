"""``GET /openapi.json``: the server's OpenAPI document, with every request body described by the
pydantic model its route validates against.

Routes read their body as raw JSON and validate it themselves (so that a bad body is a 400 in the
protocol's own error shape, never FastAPI's 422); FastAPI therefore cannot see their models.
``BodySchemas.body(Model)`` gives a route the ``openapi_extra`` that documents ``Model`` as its
JSON body, and ``install(app)`` makes the app's document carry every model (and the models they
refer to) under ``components.schemas``. The document is generated once, on first request.
"""

from __future__ import annotations

from fastapi.openapi.utils import get_openapi

_REF = "#/components/schemas/{model}"


class BodySchemas:
    """The request-body models of one app's routes (see the module docstring)."""

    def __init__(self):
        self.schemas: dict = {}

    def body(self, model, description: str | None = None) -> dict:
        """``openapi_extra`` for a route whose JSON body is validated by ``model`` (a pydantic model)."""
        schema = model.model_json_schema(ref_template=_REF)
        self.schemas.update(schema.pop("$defs", {}))
        self.schemas[model.__name__] = schema
        content = {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}
        body = {"required": True, "content": content}
        if description:
            body["description"] = description
        return {"requestBody": body}

    def install(self, app) -> None:
        """Serve ``app``'s document with these schemas in it."""

        def document() -> dict:
            if app.openapi_schema is None:
                doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                  description=app.description or None)
                doc.setdefault("components", {}).setdefault("schemas", {}).update(self.schemas)
                app.openapi_schema = doc
            return app.openapi_schema

        app.openapi = document
