"""evalkit: how much quality a sparse KV-cache policy costs, and how much it saves."""

__version__ = "0.1.0"
