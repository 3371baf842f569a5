"""The server's side of the wire. The wire formats themselves (JSON tensor objects,
safetensors bodies, OIP messages, DataProto and TensorDict documents, limits and
``WireError``) are :mod:`hybridflow_client.wire`, one implementation for the server and
the client; it decodes into numpy arrays and hands them to a builder.

- :mod:`hybridflow.wire.torch_builder`: the server's builder, which makes torch tensors (views
  of the body where they can be) and the library's DataProto and TensorDict of them.
- :mod:`hybridflow.wire.split`: a job's split of its dp-list argument, lazy and bounded.
"""
