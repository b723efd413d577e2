"""Trainer side of mmdispatch (needs torch, the `trainer` extra).

`DispatcherClient` receives this rank's pre-packed micro-batches; `Exchanger` moves encoder
outputs to the ranks that run each sample's LLM sequence; `ReferenceModel` is the small model
the demo trains and the tests check gradients with. Import submodules directly to keep
start-up light (e.g. `from trainer_client.client import DispatcherClient`).
"""
