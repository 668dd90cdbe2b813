"""The gateway's ASGI app (Litestar), assembled: the ``/v1`` routers by resource behind the
tenant's token, the operations routes, the dashboard's files and the Tinker API, with one
handler for every error and the path guard in front of every route.

What a handler shares is ``context.py``; who is asking, ``auth.py``; the operator's pages,
``operations.py``. A route module never imports this one.
"""

from __future__ import annotations

from pathlib import Path

from litestar import Litestar, Router
from litestar.datastructures import State
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin
from litestar.openapi.spec import Components, SecurityScheme
from litestar.static_files import create_static_files_router

from services.gateway.adapters import ADAPTER_ROUTES
from services.gateway.auth import authenticated_tenant, operator_only
from services.gateway.context import Gateway, error_answer, path_guard
from services.gateway.files import FILE_ROUTES
from services.gateway.operations import OPERATIONS_ROUTES
from services.gateway.samples import SAMPLE_ROUTES
from services.gateway.tinker_api import CHECKPOINT_ROUTES, TINKER_ROUTER
from services.gateway.tinker_checkpoints import SIGNED_ROUTES, TINKER_CHECKPOINT_ROUTER
from services.gateway.usage import USAGE_ROUTES
from services.gateway.views import JOB_ROUTES

UI_DIR = Path(__file__).parent / "ui"


def create_app(gateway: Gateway) -> Litestar:
    """The ASGI app serving ``gateway``."""
    v1 = Router(path="/v1", route_handlers=[*JOB_ROUTES, *SAMPLE_ROUTES, *FILE_ROUTES, *ADAPTER_ROUTES,
                                            *CHECKPOINT_ROUTES, *USAGE_ROUTES],
                dependencies={"tenant": Provide(authenticated_tenant)}, security=[{"bearer": []}])
    # the dashboard: static files that call /v1 with the token the tenant types in (ui/app.js)
    ui = create_static_files_router(path="/ui", directories=[UI_DIR], html_mode=True, name="ui")
    return Litestar(
        route_handlers=[v1, *OPERATIONS_ROUTES, ui, TINKER_ROUTER, TINKER_CHECKPOINT_ROUTER, *SIGNED_ROUTES],
        state=State({"gateway": gateway}),
        exception_handlers={Exception: error_answer},
        middleware=[path_guard],
        request_max_body_size=gateway.config.gateway.max_body_bytes,
        openapi_config=OpenAPIConfig(
            title="marlaas", version="1",
            description="Multi-tenant asynchronous RL for LLMs: upload data, submit jobs, follow them, download "
                        "adapters.",
            components=Components(security_schemes={"bearer": SecurityScheme(type="http", scheme="bearer")}),
            # Litestar always mounts /schema (its JSON, a 404 page for the rest): the operator's too;
            # only the JSON renderer, as the documentation pages' scripts come from CDNs
            render_plugins=[JsonRenderPlugin()],
            openapi_router=Router("/schema", route_handlers=[], guards=[operator_only]),
        ),
        debug=False,
    )
