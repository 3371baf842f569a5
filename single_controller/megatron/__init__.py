"""Megatron-core workers: torch.distributed + model-parallel state inside a worker group."""
