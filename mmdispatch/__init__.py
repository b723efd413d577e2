"""mmdispatch: per-phase balanced micro-batches for multimodal LLM training.

This package is the application layer only (the `mmdispatch` command); the work lives in
`pipeline` (data nodes), `dispatcher_server` (planner and server) and `trainer_client`.
"""

__version__ = "0.1.0"
