"""Step log: one JSON line per planned step, the balanced plan beside what random would give.

Computing the random-assignment baseline costs one extra (cheap) plan per step; it is what
lets users see the gain on their own data (`mmdispatch report`). Per-rank loads are logged
only up to `max_ranks_with_loads` ranks, so the log stays small at thousands of ranks.
"""

from __future__ import annotations

import fcntl
import json
import logging
import time
from pathlib import Path

from dispatcher_server.planner import PlannerConfig, StepPlan, plan_random

log = logging.getLogger("mmdispatch.server")


def _method(plan: StepPlan, with_loads: bool) -> dict:
    m = plan.metrics
    out = {
        "max_over_mean": m["max_over_mean"],
        "max_over_lb": m["max_over_lb"],
        "step_time": m["step_time"],
        "lb_step_time": m["lb_step_time"],  # (and max_over_lb) for the plan's own split
        "split_free_lb_step_time": m["split_free_lb_step_time"],  # for any split
        "bytes": m["bytes"],
        "peak_tokens": m["peak_tokens"],
    }
    if with_loads:
        out["loads"] = {p: loads.tolist() for p, loads in m["loads"].items()}
    return out


def plan_record(step: int, plan: StepPlan, *, config: PlannerConfig, plan_ms: float,
                epoch: int = 0, max_ranks_with_loads: int = 64,
                sources: dict[str, int] | None = None) -> dict:
    """The JSON-able record of one step: balanced plan metrics and the random baseline's, and
    samples per dataset source when there are several."""
    baseline = plan_random(plan.inputs, plan.topology, config)
    with_loads = plan.topology.world_size <= max_ranks_with_loads
    rnd, bal = _method(baseline, with_loads), _method(plan, with_loads)
    return {
        "kind": "plan", "step": step, "epoch": epoch, "time": time.time(), "plan_ms": plan_ms,
        "num_samples": plan.inputs.num_samples, "world_size": plan.topology.world_size,
        "ranks_per_node": plan.topology.ranks_per_node, "num_microbatches": plan.num_microbatches,
        "balanced": bal, "random": rnd,
        "predicted_speedup_vs_random": rnd["step_time"] / bal["step_time"] if bal["step_time"] > 0 else 1.0,
        # what `bytes` assume an encoder output token weighs: the cost model's, else a default
        # (those phases listed in `bytes_assumed`)
        "bytes_per_token": {p: config.bytes_for(p) for p in plan.inputs.encoders},
        "bytes_assumed": [p for p in plan.inputs.encoders if p not in config.bytes_per_token],
        **({"sources": sources} if sources else {}),
    }


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line without its newline (a record a killed writer left unfinished), so that
    the records appended next start a line of their own."""
    try:
        f = open(path, "r+b")
    except FileNotFoundError:
        return
    with f:
        size = f.seek(0, 2)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        start = max(0, size - (1 << 20))
        while True:  # back to the last newline, a MiB at a time
            f.seek(start)
            end = f.read(size - start).rfind(b"\n")
            if end >= 0 or start == 0:
                f.truncate(start + end + 1)
                return
            size, start = start, max(0, start - (1 << 20))


def _unwritable(path: str | Path, e: OSError) -> ValueError:
    return ValueError(f"--step-log {str(path)!r} cannot be written ({e.strerror or e}): give a "
                      "file in a directory the dispatcher can write")


class StepLog:
    """Appends JSON lines to a file, flushed per record so `mmdispatch report` can read it live.

    A diagnostic, not the job's state: a write that fails (disk full, a file size limit) is
    logged once, naming the file, and the log stops there while the job goes on (a torn last
    line is cut at the next open)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", encoding="utf-8")
        except OSError as e:  # not writable by this user, a read-only filesystem
            raise _unwritable(path, e) from None
        try:  # held while this dispatcher appends: another one's records would interleave
            fcntl.flock(self._f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._f.close()
            raise ValueError(f"--step-log {str(path)!r} is appended to by another dispatcher "
                             "running now: two jobs' steps would interleave in it; give each "
                             "job its own step log") from None
        except OSError:
            pass  # a filesystem without locks (some network mounts): appended unguarded
        try:
            _drop_torn_tail(self.path)
        except OSError as e:
            self._f.close()
            raise _unwritable(path, e) from None
        self.failed: str | None = None  # why the log stopped, if it did

    def write(self, record: dict) -> None:
        if self._f is None:
            return
        try:
            self._f.write(json.dumps(record, separators=(",", ":")) + "\n")
            self._f.flush()
        except OSError as e:
            self.failed = e.strerror or str(e)
            log.warning("mmdispatch event=step_log_failed path=%s step=%s error=%r: the step log "
                        "stops here and the job goes on (free the space, or point --step-log "
                        "elsewhere, for the next run)", self.path, record.get("step"), self.failed)
            self.close()

    def close(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass  # its buffer could not be written: the failure is logged
