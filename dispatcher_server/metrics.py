"""Observability of the dispatcher: Prometheus metrics over HTTP and one-line structured log events.

Metrics live in the server's own CollectorRegistry (several dispatchers in one test process
never collide); the HTTP endpoint starts only when a port is configured. Log events are one
line each, `mmdispatch event=NAME k=v ...`, so they grep and parse without a log schema.
"""

from __future__ import annotations

import errno
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dispatcher_server.cliopts import event_line, redact
from dispatcher_server.metrics_endpoint import MetricsServer, serve_metrics

log = logging.getLogger("mmdispatch.server")


#: Error lines of one kind logged a minute at most (`Metrics.error`; the counter counts all).
ERROR_LINES_PER_MINUTE = 20


def event(kind: str, level: int = logging.INFO, /, **fields) -> None:
    """Log one structured line (`event_line`) on the dispatcher's logger."""
    if log.isEnabledFor(level):
        log.log(level, "%s", event_line(kind, **fields))


#: What the loop thread's CPU time is split into (`mmdispatch_loop_cpu_seconds_total{part}`):
#: reader messages taken in, trainer messages (credits, acknowledgements, commits), filling and
#: building steps, planning, journaling, encoding rank messages, sending them, and `loop`: the
#: rest (polling, liveness and heartbeats, the window, eviction, reader credits, metrics and
#: bookkeeping), so that the parts add up to the thread's CPU.
LOOP_PARTS = ("intake", "acks", "assemble", "plan", "journal", "encode", "send", "loop")


class Metrics:
    """The dispatcher's counters and gauges."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1") -> None:
        self.registry = r = CollectorRegistry()
        self.steps_served = Counter("mmdispatch_steps_served", "Steps planned and journaled (each "
                                    "goes to a rank once it grants credit for it)", registry=r)
        self.samples_in = Counter("mmdispatch_samples_in", "Samples received from readers", registry=r)
        self.source_samples = Counter("mmdispatch_source_samples", "Samples planned into steps, "
                                      "by dataset source ('default' for --shards)", ["source"],
                                      registry=r)
        self.plan_ms = Histogram("mmdispatch_plan_ms", "Planner time per step (ms)", registry=r,
                                 buckets=(0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000))
        self.imbalance = Gauge("mmdispatch_imbalance_max_over_mean",
                               "Last step's per-phase load imbalance (max/mean)", ["phase"], registry=r)
        self.buffered_samples = Gauge("mmdispatch_buffered_samples",
                                      "Samples held (shard buffers, step being filled, retained steps)",
                                      registry=r)
        self.buffered_bytes = Gauge("mmdispatch_buffered_bytes", "Payload bytes held", registry=r)
        self.retained_steps = Gauge("mmdispatch_retained_steps",
                                    "Steps planned and held until every rank acknowledged "
                                    "them (sent as ranks grant credit)", registry=r)
        self.uncommitted_steps = Gauge("mmdispatch_uncommitted_steps",
                                       "Steps planned since the last commit (the replay history "
                                       "kept for them grows until trainers commit)", registry=r)
        self.bytes_in = Counter("mmdispatch_bytes_in", "Bytes received", ["role"], registry=r)
        self.bytes_out = Counter("mmdispatch_bytes_out", "Bytes sent", ["role"], registry=r)
        # Per-message counters by role, resolved once: labels() locks and looks up every call.
        self.bytes_in_of = {role: self.bytes_in.labels(role) for role in ("reader", "trainer")}
        self.bytes_out_of = {role: self.bytes_out.labels(role) for role in ("reader", "trainer")}
        self.peers = Gauge("mmdispatch_peers_connected", "Connected peers", ["role"], registry=r)
        self.halted = Gauge("mmdispatch_halted", "1 once the job stopped on an error (the log's "
                            "event=fatal says why): the dispatcher only tells ranks why, then "
                            "exits", registry=r)
        self.errors = Counter("mmdispatch_errors", "Errors by kind", ["kind"], registry=r)
        self.skipped = Counter("mmdispatch_samples_skipped",
                               "Skip records: a bad sample each (skipped by a reader, or by the "
                               "dispatcher after --max-shard-losses readers were lost at it), or "
                               "the unreadable rest of a shard (truncated_tar, shard_stalled, "
                               "shard_failed; its sample count unknown): the log names each",
                               registry=r)
        self.members_ignored = Counter("mmdispatch_members_ignored",
                                       "Shard members no field map kind names, by source and "
                                       "suffix (their extension; '' for names without one)",
                                       ["source", "suffix"], registry=r)
        self.samples_truncated = Counter("mmdispatch_samples_truncated",
                                         "Samples whose text readers cut to their --max-seq-len "
                                         "(--over-length truncate), by source", ["source"], registry=r)
        self.slowest_rank = Gauge("mmdispatch_phase_slowest_rank",
                                  "Last measured step: slowest rank per phase, summed over "
                                  "micro-batches (predicted: cost-model units; measured: seconds)",
                                  ["phase", "source"], registry=r)
        self.measured_imbalance = Gauge("mmdispatch_measured_imbalance_max_over_mean",
                                        "Last measured step's per-phase imbalance (max/mean)",
                                        ["phase"], registry=r)
        self.measured_step = Gauge("mmdispatch_measured_step_seconds",
                                   "Last measured step: sum over phases and micro-batches of the "
                                   "slowest rank's seconds (exchange excluded)", registry=r)
        self.loop_cpu = Counter("mmdispatch_loop_cpu_seconds", "CPU seconds of the dispatcher's "
                                "loop thread by part of its work", ["part"], registry=r)
        self.cpu_of = {part: self.loop_cpu.labels(part) for part in LOOP_PARTS}
        self.messages = Counter("mmdispatch_messages", "Messages by role and direction",
                                ["role", "direction"], registry=r)
        self.messages_of = {(role, d): self.messages.labels(role, d)
                            for role in ("reader", "trainer") for d in ("in", "out")}
        self.port = 0
        self._server: MetricsServer | None = None
        self._error_lines: dict[str, tuple[float, int, int]] = {}  # kind -> (since, logged, held)
        if port:
            try:
                self._server = serve_metrics(r, port, host)
            except OSError as e:
                why = e.strerror or str(e)
                if e.errno in (errno.EADDRINUSE, errno.EACCES):
                    fix = "choose another --metrics-port (0 turns metrics off)"
                else:  # not an address of this machine, or not a host name at all
                    fix = ("give --metrics-host an address of this machine (127.0.0.1, or "
                           "0.0.0.0 for every interface)")
                error = OSError(f"metrics endpoint {host}:{port} cannot bind ({why}): {fix}")
                error.errno = e.errno  # kept for callers; the line reads without "[Errno N]"
                raise error from e
            self.port = self._server.server_port

    def measured(self, summary: dict) -> None:
        """Export a step's predicted-vs-measured record (see dispatcher_server.measure)."""
        for phase, v in summary["phases"].items():
            self.slowest_rank.labels(phase, "predicted").set(v["predicted_max"])
            self.slowest_rank.labels(phase, "measured").set(v["measured_max"])
            self.measured_imbalance.labels(phase).set(v["measured_max_over_mean"])
        self.measured_step.set(summary["measured_step_s"])

    def ignored(self, source: str, suffix: str, count: int) -> None:
        """Count `count` ignored members of one suffix (`mmdispatch_members_ignored_total`)."""
        self.members_ignored.labels(source, suffix).inc(count)

    def error(self, kind: str, level: int = logging.WARNING, /, **fields) -> None:
        """Count an error by kind, and log it at `level`: every one of a kind up to
        ERROR_LINES_PER_MINUTE a minute, then none until the minute is over (the next line says
        how many were not logged): one peer sending garbage must not flood the log."""
        self.errors.labels(kind).inc()
        now = time.monotonic()
        start, logged, held = self._error_lines.get(kind, (now, 0, 0))
        if now - start >= 60.0:
            start, logged = now, 0
        if logged >= ERROR_LINES_PER_MINUTE:
            self._error_lines[kind] = (start, logged, held + 1)
            return
        self._error_lines[kind] = (start, logged + 1, 0)
        more = {"not_logged_before": held} if held else {}
        event("error", level, kind=kind, **fields, **more)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


#: How a skip log line names the unread rest of a shard (a skip record of index -1).
REST_OF_SHARD = "(the rest of the shard)"


class SkipLog:
    """Skipped samples: every key kept (and counted in the metrics), but logged as one line per
    (shard, reason): at once the first time, then at most once every `every_s` seconds with the
    count since, so a bad shard of 10,000 samples is a few warnings, not 10,000."""

    def __init__(self, metrics: Metrics, every_s: float = 5.0) -> None:
        self.metrics = metrics
        self.every_s = every_s
        self.keys: list[tuple[str, str]] = []  # (key, reason) in the order reported
        self._pending: dict[tuple[str, str], list[str]] = {}  # (shard, reason) -> keys
        self._logged: set[tuple[str, str]] = set()  # logged in the current interval
        self._interval_start = 0.0
        self.first_shard: dict[str, str] = {}  # reason -> the first shard with it (redacted: for messages)

    def add(self, shard: str, skipped: list) -> None:
        """Take (key, reason, index) records of one shard; a (shard, reason) not logged in this
        interval is logged at once."""
        self.keys.extend((s[0], s[1]) for s in skipped)
        for s in skipped:
            if s[1] not in self.first_shard:
                self.first_shard[s[1]] = redact(shard)
        self.metrics.skipped.inc(len(skipped))
        for key, reason, *where in skipped:
            if not key:  # a shard-level failure (index -1) names no sample; an empty key, its index
                index = where[0] if where else -1
                key = REST_OF_SHARD if index is None or index < 0 else f"(sample #{index})"
            what = (shard, reason)
            if what in self._logged:
                self._pending.setdefault(what, []).append(key)
            else:
                self._logged.add(what)
                self._log(what, [key])

    def flush(self, now: float | None) -> None:
        """Once the interval is over (or when `now` is None, at shutdown), log what accumulated
        since each (shard, reason) was last logged."""
        if now is not None and now - self._interval_start < self.every_s:
            return
        for what, keys in self._pending.items():
            self._log(what, keys)
        self._pending.clear()
        self._logged.clear()
        self._interval_start = 0.0 if now is None else now

    @staticmethod
    def _log(what: tuple[str, str], keys: list[str]) -> None:
        """`count`: the samples named; the unread rest of a shard (a shard-level failure, its
        sample count unknown) is said as `rest_of_shard=unread`, not counted as one sample."""
        shown = ",".join(keys[:5]) + (",..." if len(keys) > 5 else "")
        named = sum(key != REST_OF_SHARD for key in keys)
        rest = named < len(keys)
        event("sample_skipped", logging.WARNING, shard=what[0], reason=what[1],
              **({"count": named} if named or not rest else {}),
              **({"rest_of_shard": "unread"} if rest else {}), keys=shown)
