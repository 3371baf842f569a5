"""The RPCs Serve's gRPC proxy accepts: ``add_inference_service`` is what the serve config's
``grpc_options.grpc_servicer_functions`` names.

It registers the RPCs of KServe v2's ``inference.GRPCInferenceService`` that this service
answers, with no request deserializer: the proxy forwards each request's bytes as they
came, and the ingress replica parses them (``hybridflow.oip_grpc.service``). The proxy
thus never decodes a tensor, and nothing but bytes crosses from it to the replica (the
stubs tritonclient generates name their messages' module ``grpc_service_pb2``, which no
process can import, so their messages could not be passed on as objects). The service's
other RPCs (statistics, the repository, shared memory, streaming) are not registered:
gRPC answers them UNIMPLEMENTED at the proxy. Imports nothing but grpc, as the proxy
imports this module.
"""

from __future__ import annotations

from typing import Any

import grpc

__all__ = ["SERVED_RPCS", "SERVICE", "add_inference_service"]

SERVICE = "inference.GRPCInferenceService"
#: The RPCs this service answers, all unary.
SERVED_RPCS = ("ServerLive", "ServerReady", "ServerMetadata", "ModelReady", "ModelMetadata", "ModelInfer")


def _unrouted(request: bytes, context: grpc.ServicerContext) -> bytes:
    """Never called under Serve, whose proxy replaces every handler with its route to the
    ingress; a plain gRPC server that registered the service this way answers this."""
    context.abort(grpc.StatusCode.UNIMPLEMENTED, "the RPCs are answered by the Serve ingress deployment")
    return b""


def add_inference_service(servicer: Any, server: grpc.Server) -> None:
    """Register the served RPCs of ``inference.GRPCInferenceService`` on ``server``
    (``servicer`` is unused: Serve routes each RPC to the ingress method of its name)."""
    handlers = {rpc: grpc.unary_unary_rpc_method_handler(_unrouted) for rpc in SERVED_RPCS}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
