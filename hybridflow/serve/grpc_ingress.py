"""The gRPC side of the ingress deployments: KServe v2's ``inference.GRPCInferenceService``.

Serve's gRPC proxy (``grpc_options`` in the serve config, whose
``grpc_servicer_functions`` names :func:`hybridflow.oip_grpc.registration.add_inference_service`)
routes each RPC to the application's ingress deployment by the RPC's name, passing the
request's bytes and, to a method with a ``grpc_context`` argument, the call's context.
:class:`GrpcIngress` gives both ingress classes (``ingress.Ingress``,
``ingress_controllers.ControllingIngress``) one method per RPC, each handing the call to
:class:`hybridflow.oip_grpc.service.OipGrpcService` over the same backend, settings and
token as the HTTP routes; Serve sends the message each returns.

Each RPC the ingress answers is counted by its status in ``ray_hybridflow_grpc_requests_total``
(labels ``rpc`` and ``code``, e.g. ``OK``, ``UNAUTHENTICATED``): a refusal is answered as a
status on the context, which Serve's own request counter records as a success.
"""

from __future__ import annotations

from typing import Any

from ray.serve import metrics as serve_metrics
from ray.serve.grpc_util import RayServegRPCContext

from hybridflow.control.backend import Backend
from hybridflow.http import oip
from hybridflow.http.settings import IngressSettings
from hybridflow.oip_grpc.service import GrpcSettings, OipGrpcService


def grpc_settings(settings: IngressSettings) -> GrpcSettings:
    """The gRPC service's settings from the ingress's: the same models, token and bounds."""
    return GrpcSettings(
        models={name: tuple(route.outputs) for name, route in settings.models.items()},
        auth_token=settings.auth_token,
        max_message_bytes=settings.max_body_bytes,
        limits=settings.wire_limits(),
        server_name=oip.SERVER_NAME,
        server_version=oip.SERVER_VERSION,
    )


class GrpcIngress:
    """The RPC methods of an ingress deployment; its ``__init__`` calls :meth:`serve_grpc`."""

    oip_grpc: OipGrpcService
    grpc_requests: serve_metrics.Counter

    def serve_grpc(self, backend: Backend, settings: IngressSettings) -> None:
        self.oip_grpc = OipGrpcService(backend, grpc_settings(settings))
        self.grpc_requests = serve_metrics.Counter(
            "hybridflow_grpc_requests",
            description="OIP gRPC requests the ingress answered, by RPC and status code.",
            tag_keys=("rpc", "code"),
        )

    def _counted(self, rpc: str, grpc_context: RayServegRPCContext, answer: Any) -> Any:
        code = grpc_context.code()
        self.grpc_requests.inc(tags={"rpc": rpc, "code": code.name if code else "OK"})
        return answer

    async def ServerLive(self, request: bytes, grpc_context: RayServegRPCContext) -> Any:
        answer = await self.oip_grpc.server_live(request, grpc_context)
        return self._counted("ServerLive", grpc_context, answer)

    async def ServerReady(self, request: bytes, grpc_context: RayServegRPCContext) -> Any:
        answer = await self.oip_grpc.server_ready(request, grpc_context)
        return self._counted("ServerReady", grpc_context, answer)

    async def ServerMetadata(self, request: bytes, grpc_context: RayServegRPCContext) -> Any:
        answer = await self.oip_grpc.server_metadata(request, grpc_context)
        return self._counted("ServerMetadata", grpc_context, answer)

    async def ModelReady(self, request: bytes, grpc_context: RayServegRPCContext) -> Any:
        answer = await self.oip_grpc.model_ready(request, grpc_context)
        return self._counted("ModelReady", grpc_context, answer)

    async def ModelMetadata(self, request: bytes, grpc_context: RayServegRPCContext) -> Any:
        answer = await self.oip_grpc.model_metadata(request, grpc_context)
        return self._counted("ModelMetadata", grpc_context, answer)

    async def ModelInfer(self, request: bytes, grpc_context: RayServegRPCContext) -> Any:
        answer = await self.oip_grpc.model_infer(request, grpc_context)
        return self._counted("ModelInfer", grpc_context, answer)
