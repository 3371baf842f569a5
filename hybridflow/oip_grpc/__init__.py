"""The Open Inference Protocol over gRPC (KServe v2 ``inference.GRPCInferenceService``):
its messages to and from the wire's tensors (``messages``), the status codes it answers
(``status``) and its RPCs over the controllers (``service``). No Serve here: the ingress
deployments (``hybridflow.serve``) hand the RPCs that Serve's gRPC proxy routes to them
to :class:`hybridflow.oip_grpc.service.OipGrpcService`."""
