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
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"


class BodySchemas:
    """The request-body models of one app's routes (see the module docstring). Models of different
    protocols may share a class name (chat's and Anthropic's ``Tool``): the schemas are generated
    together, and pydantic gives colliding names their module's prefix."""

    def __init__(self):
        self.models: list = []  # (model, the route's schema dict, filled in by install)

    def body(self, model, description: str | None = None) -> dict:
        """``openapi_extra`` for a route whose JSON body is validated by ``model`` (a pydantic model)."""
        schema: dict = {}
        self.models.append((model, schema))
        body = {"required": True, "content": {"application/json": {"schema": schema}}}
        if description:
            body["description"] = description
        return {"requestBody": body}

    def install(self, app) -> None:
        """Serve ``app``'s document with these schemas in it."""
        refs, document_defs = models_json_schema([(m, "validation") for m, _ in self.models], ref_template=_REF)
        for model, schema in self.models:
            schema.update(refs[(model, "validation")])
        schemas = document_defs.get("$defs", {})

        def document() -> dict:
            if app.openapi_schema is None:
                doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                  description=app.description or None)
                doc.setdefault("components", {}).setdefault("schemas", {}).update(schemas)
                app.openapi_schema = doc
            return app.openapi_schema

        app.openapi = document
