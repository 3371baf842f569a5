"""verl v0.4's import path for the Megatron worker: ``single_controller.base.megatron.worker``."""
