"""The ingress of the layout with controllers in replicas of their own: a Serve deployment
serving :func:`hybridflow.http.app.create_app`, and the Open Inference Protocol over gRPC
(:class:`hybridflow.serve.grpc_ingress.GrpcIngress`), over the controllers' handles (one
hop from the ingress to the controller that owns a group). It holds no state, so it
scales out."""

from __future__ import annotations

import warnings
from typing import Any

from fastapi import FastAPI
from ray import serve

from hybridflow.http.app import create_app
from hybridflow.http.settings import IngressSettings
from hybridflow.serve.backend import ServeBackend, ServeJobs
from hybridflow.serve.grpc_ingress import GrpcIngress
from hybridflow.serve.preload import load_batch_types


@serve.deployment(name="ingress", max_ongoing_requests=256)
@serve.ingress()
class Ingress(GrpcIngress):
    def __init__(self, controllers: dict[str, Any], settings: dict[str, Any], jobs: Any = None) -> None:
        # Ray warns on every zero-copy send (see hybridflow.serve.application.INGRESS_RUNTIME_ENV):
        # the ingress never writes to the tensors it sends, which is what the warning is about.
        warnings.filterwarnings("ignore", message="Zero-copy tensor serialization is enabled")
        load_batch_types()  # no request pays their import with the loop waiting
        self.settings = IngressSettings.model_validate(settings)
        self.backend = ServeBackend(controllers, self.settings)
        self.jobs = None if jobs is None else ServeJobs(jobs, self.settings.request_timeout_s)
        self.serve_grpc(self.backend, self.settings)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_app(self.backend, self.settings, self.jobs)
