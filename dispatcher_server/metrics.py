"""Observability of the dispatcher: Prometheus metrics over HTTP and one-line structured log events.

Metrics live in the server's own CollectorRegistry (several dispatchers in one test process
never collide); the HTTP endpoint starts only when a port is configured. Log events are one
line each, `mmdispatch event=NAME k=v ...`, so they grep and parse without a log schema.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger("mmdispatch.server")


def event(kind: str, level: int = logging.INFO, /, **fields) -> None:
    """Log one structured line; values with spaces are quoted."""
    if not log.isEnabledFor(level):
        return
    parts = [f"event={kind}"]
    for k, v in fields.items():
        text = str(v)
        parts.append(f"{k}={text!r}" if (" " in text or not text) else f"{k}={text}")
    log.log(level, "mmdispatch %s", " ".join(parts))


class Metrics:
    """The dispatcher's counters and gauges."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1") -> None:
        self.registry = r = CollectorRegistry()
        self.steps_served = Counter("mmdispatch_steps_served", "Steps planned and sent", registry=r)
        self.samples_in = Counter("mmdispatch_samples_in", "Samples received from readers", registry=r)
        self.plan_ms = Histogram("mmdispatch_plan_ms", "Planner time per step (ms)", registry=r,
                                 buckets=(0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000))
        self.imbalance = Gauge("mmdispatch_imbalance_max_over_mean",
                               "Last step's per-phase load imbalance (max/mean)", ["phase"], registry=r)
        self.buffered_samples = Gauge("mmdispatch_buffered_samples",
                                      "Samples held (shard buffers, step being filled, retained steps)",
                                      registry=r)
        self.buffered_bytes = Gauge("mmdispatch_buffered_bytes", "Payload bytes held", registry=r)
        self.retained_steps = Gauge("mmdispatch_retained_steps",
                                    "Steps sent but not acknowledged by every rank", registry=r)
        self.bytes_in = Counter("mmdispatch_bytes_in", "Bytes received", ["role"], registry=r)
        self.bytes_out = Counter("mmdispatch_bytes_out", "Bytes sent", ["role"], registry=r)
        # Per-message counters by role, resolved once: labels() locks and looks up every call.
        self.bytes_in_of = {role: self.bytes_in.labels(role) for role in ("reader", "trainer")}
        self.bytes_out_of = {role: self.bytes_out.labels(role) for role in ("reader", "trainer")}
        self.peers = Gauge("mmdispatch_peers_connected", "Connected peers", ["role"], registry=r)
        self.errors = Counter("mmdispatch_errors", "Errors by kind", ["kind"], registry=r)
        self.skipped = Counter("mmdispatch_samples_skipped", "Bad samples skipped by readers",
                               registry=r)
        self.port = 0
        self._server = None
        if port:
            try:
                self._server, _ = start_http_server(port, addr=host, registry=r)
            except OSError as e:
                raise OSError(e.errno, f"metrics endpoint {host}:{port} cannot bind ({e.strerror}): "
                                       f"choose another --metrics-port (0 turns metrics off)") from e
            self.port = self._server.server_port

    def error(self, kind: str, /, **fields) -> None:
        self.errors.labels(kind).inc()
        event("error", logging.WARNING, kind=kind, **fields)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
