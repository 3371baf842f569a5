"""The API docs: the OpenAPI schema, Swagger UI and ReDoc, behind the token like every
route but the probes (the pages send a browser without it to the login form).

The pages' scripts and styles are served from the ingress itself (the pinned
``fastapi-offline`` package ships Swagger UI 5 and ReDoc), not from a CDN: many clusters
cannot reach one, and Swagger UI 5 is the first to render OpenAPI 3.1, which FastAPI
writes.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Depends, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse

from hybridflow.http.auth import require_page_token, require_token
from hybridflow.http.errors import ApiError

ASSETS = resources.files("fastapi_offline").joinpath("static")
#: The files the pages load, and their media types.
ASSET_TYPES = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "redoc.standalone.js": "text/javascript",
    "favicon.png": "image/png",
}
ASSET_PATH = "/docs/assets"

router = APIRouter(include_in_schema=False)


@router.get("/openapi.json", dependencies=[Depends(require_token)])
async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


@router.get("/docs", dependencies=[Depends(require_page_token)])
async def swagger_ui(request: Request) -> HTMLResponse:
    return get_swagger_ui_html(
        openapi_url="/openapi.json",
        title=f"{request.app.title} - docs",
        swagger_js_url=f"{ASSET_PATH}/swagger-ui-bundle.js",
        swagger_css_url=f"{ASSET_PATH}/swagger-ui.css",
        swagger_favicon_url=f"{ASSET_PATH}/favicon.png",
    )


@router.get("/redoc", dependencies=[Depends(require_page_token)])
async def redoc(request: Request) -> HTMLResponse:
    return get_redoc_html(
        openapi_url="/openapi.json",
        title=f"{request.app.title} - ReDoc",
        redoc_js_url=f"{ASSET_PATH}/redoc.standalone.js",
        redoc_favicon_url=f"{ASSET_PATH}/favicon.png",
        with_google_fonts=False,
    )


@router.get(ASSET_PATH + "/{name}", dependencies=[Depends(require_token)])
async def asset(name: str) -> FileResponse:
    media = ASSET_TYPES.get(name)
    if media is None:
        raise ApiError(404, f"no asset {name!r}")
    # One version per installed package: browsers may keep it for a day.
    return FileResponse(str(ASSETS.joinpath(name)), media_type=media, headers={"Cache-Control": "private, max-age=86400"})
