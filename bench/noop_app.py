"""The floor for the HTTP figures: a no-op route on a bare Serve FastAPI deployment."""

from fastapi import FastAPI, Request
from fastapi.responses import Response
from ray import serve

noop_api = FastAPI()


@serve.deployment(name="noop", max_ongoing_requests=256, ray_actor_options={"num_cpus": 0.05})
@serve.ingress(noop_api)
class NoOp:
    @noop_api.get("/ready")
    async def ready(self) -> dict:
        return {"ok": True}

    @noop_api.post("/call")
    async def call(self, request: Request) -> Response:
        await request.body()  # read what was sent, as a real route must
        return Response(b"{}", media_type="application/json")


app = NoOp.bind()
