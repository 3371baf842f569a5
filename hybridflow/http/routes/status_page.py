"""The status page: one static HTML file (no build step) whose script reads the JSON API
(``/v1/groups``, ``/v1/groups/{group}``, ``/v1/jobs``) and refreshes itself. Behind the
token: a browser without it is sent to the login form."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Depends
from fastapi.responses import FileResponse

from hybridflow.http.auth import require_page_token

PAGE = Path(__file__).resolve().parent.parent / "static" / "status.html"

router = APIRouter(include_in_schema=False, dependencies=[Depends(require_page_token)])


@router.get("/")
@router.get("/ui")
async def status_page() -> FileResponse:
    return FileResponse(PAGE, media_type="text/html", headers={"Cache-Control": "no-store"})
