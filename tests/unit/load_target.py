"""A small HTTP target for the load generator's tests: it counts what it answers, fails
every third request of one route, answers another in chunks or closing the connection,
and burns a fixed CPU time per request on another.

    python -m uvicorn tests.unit.load_target:app --port P   (the CPU test runs it so)
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

app = FastAPI()
counts = {"count": 0, "fail": 0, "chunked": 0, "close": 0, "burn": 0}
#: CPU seconds a ``/burn`` request spends.
BURN_S = 0.02


@app.post("/count")
async def count(request: Request) -> Response:
    counts["count"] += 1
    return Response(b'{"n": %d}' % len(await request.body()), media_type="application/json")


@app.post("/fail")
async def fail(request: Request) -> Response:
    await request.body()
    counts["fail"] += 1
    if counts["fail"] % 3 == 0:
        return JSONResponse({"error": "every third request fails"}, status_code=500)
    return Response(b"{}", media_type="application/json")


@app.post("/chunked")
async def chunked(request: Request) -> StreamingResponse:
    await request.body()
    counts["chunked"] += 1

    async def parts():
        for part in (b"one ", b"two ", b"three"):
            yield part

    return StreamingResponse(parts(), media_type="text/plain")


@app.post("/close")
async def close(request: Request) -> Response:
    await request.body()
    counts["close"] += 1
    return Response(b"{}", media_type="application/json", headers={"Connection": "close"})


@app.post("/burn")
async def burn(request: Request) -> Response:
    await request.body()
    counts["burn"] += 1
    end = time.process_time() + BURN_S
    while time.process_time() < end:
        pass
    return Response(b"{}", media_type="application/json")


@app.get("/counts")
async def served() -> dict[str, int]:
    return counts
