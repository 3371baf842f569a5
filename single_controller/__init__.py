"""HybridFlow single-controller library: one controller drives groups of Ray actor workers."""
