"""Soak: stream at full rate for minutes while readers are SIGKILLed and restarted, and audit.

`mmdispatch serve` (journal, fixed loopback ports), N `mmdispatch read` processes and one
trainer thread per rank in this process, consuming as fast as steps arrive. Every
`--reader-restart-s` one reader (never r0, the long-lived one) is SIGKILLed and a new one
started; with `--dispatcher-restart` the dispatcher is SIGKILLed once, mid-run, and restarted
from its journal. When time is up, faults stop and the run ends at the next epoch boundary.

Figures (`--json`):
- samples_delivered: sample deliveries counted at the trainers, all epochs.
- samples_lost: over completed epochs, corpus keys neither delivered nor reported skipped.
- samples_duplicated: deliveries of an (epoch, key) beyond its first.
- faults_injected / faults_survived: SIGKILLs; one is survived when every rank receives a new
  step within 30 s after it.
- rss: per process incarnation (dispatcher#k, reader NAME, trainers = this process) its RSS
  after warm-up, at its peak and at its end, in MiB.
- rss_growth: the largest (final - after_warmup) / after_warmup over the incarnations that
  lived at least twice the warm-up; after_warmup is the first RSS sample taken `warmup`
  seconds (20% of the run, at least 5 s) after the incarnation started, final its last
  sample (taken every 0.25 s). Target under 0.10.
- journal_mib: the journal directory's size (journal.mmd, plan files, skipped.mmd) just before
  the dispatcher restart, once the restarted one reopened it, and at the end: at most about
  twice `--journal-plan-file-mb` plus journal.mmd, which checkpoints keep near the journal's
  `journal_file_bytes` (1 MiB by default), plus the skipped keys.
- longest_stall_s: the longest gap between two consecutive steps on any rank (fault recovery
  included: the heartbeat timeout of a killed reader bounds it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

from mmdispatch.serve import read_ready
from pipeline.gendata import generate
from pipeline.reader import iter_samples


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _spawn(args: list[str], log: str) -> subprocess.Popen:
    with open(log, "ab") as err:
        return subprocess.Popen([sys.executable, "-m", "mmdispatch.cli", *args],
                                stdout=subprocess.PIPE, stderr=err, text=True)


def _ready(proc: subprocess.Popen, timeout: float = 60.0) -> dict:
    return read_ready(proc.stdout, timeout)


def _kill(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)


class Proc:
    """One process incarnation and its RSS samples."""

    def __init__(self, name: str, pid: int, popen: subprocess.Popen | None = None) -> None:
        self.name, self.pid, self.popen = name, pid, popen
        self.started = time.monotonic()
        self.samples: list[tuple[float, int]] = []
        self.ended: float | None = None

    def sample(self, now: float) -> None:
        if self.ended is None:
            rss = _rss(self.pid)
            if rss:
                self.samples.append((now, rss))

    def figures(self, warmup: float) -> dict:
        after = next((r for t, r in self.samples if t - self.started >= warmup), None)
        rss = [r for _, r in self.samples] or [0]
        mib = 1 << 20
        return {"after_warmup_mib": None if after is None else round(after / mib, 1),
                "peak_mib": round(max(rss) / mib, 1), "final_mib": round(rss[-1] / mib, 1),
                "lived_s": round((self.ended or time.monotonic()) - self.started, 1)}


class Soak:
    def __init__(self, args: argparse.Namespace, tmp: str) -> None:
        self.args, self.tmp = args, tmp
        self.shards = generate(os.path.join(tmp, "data"), num_samples=args.samples,
                               num_shards=args.shards, seed=7)
        self.keys = {r.key for r in iter_samples(self.shards)}
        self.reader_port, self.trainer_port = _free_port(), _free_port()
        self.procs: list[Proc] = []
        self.readers: dict[str, Proc] = {}
        self.server: Proc | None = None
        self.num_servers = 0
        # Bookkeeping stays O(corpus): an epoch's counts are folded into totals once every rank
        # moved past it, so the trainers' RSS measures the client, not this audit.
        self.open_epochs: dict[int, Counter] = {}  # epoch -> key -> deliveries
        self.totals = Counter()  # delivered, lost, duplicated, epochs
        self.last_step: dict[int, float] = {}
        self.longest_gap = 0.0
        self.last_epoch: dict[int, int] = {}
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.journal_mib: dict[str, float] = {}

    # -- processes ---------------------------------------------------------------------------
    def start_server(self) -> None:
        a = self.args
        log = os.path.join(self.tmp, "serve.log")
        popen = _spawn(["serve", "--shards", *self.shards, "--world-size", str(a.world_size),
                        "--global-batch", str(a.global_batch), "--num-microbatches", "2",
                        "--max-epochs", "0", "--journal-dir", os.path.join(self.tmp, "journal"),
                        "--no-fsync", "--journal-plan-file-mb", str(a.journal_plan_file_mb),
                        "--heartbeat", "0.5", "--timeout", "2",
                        "--reader-bind", f"tcp://127.0.0.1:{self.reader_port}",
                        "--trainer-bind", f"tcp://127.0.0.1:{self.trainer_port}",
                        "--log-level", "WARNING"], log)
        self.ready = _ready(popen)
        self.server = Proc(f"dispatcher#{self.num_servers}", popen.pid, popen)
        self.num_servers += 1
        self.procs.append(self.server)

    def start_reader(self, name: str) -> None:
        popen = _spawn(["read", "--dispatcher", f"tcp://127.0.0.1:{self.reader_port}",
                        "--timeout", "2", "--name", name], os.path.join(self.tmp, "read.log"))
        p = Proc(f"reader {name}", popen.pid, popen)
        self.readers[name] = p
        self.procs.append(p)

    def kill(self, p: Proc) -> None:
        _kill(p.popen)
        p.ended = time.monotonic()

    # -- trainers ----------------------------------------------------------------------------
    def train(self, rank: int) -> None:
        from trainer_client.client import ClientConfig, DispatcherClient

        client = DispatcherClient(f"tcp://127.0.0.1:{self.trainer_port}", rank,
                                  self.args.world_size, self.args.world_size,
                                  config=ClientConfig(heartbeat_s=0.5, timeout_s=2.0,
                                                      step_timeout_s=120, backoff_max_s=0.5))
        try:
            for step in client:
                counts = self.open_epochs.setdefault(step.epoch, Counter())
                for mb in step.microbatches:
                    counts.update(mb.keys)
                now = time.monotonic()
                if rank in self.last_step:
                    self.longest_gap = max(self.longest_gap, now - self.last_step[rank])
                self.last_step[rank] = now
                self.last_epoch[rank] = step.epoch
                if (step.step + 1) % 20 == 0:
                    client.commit(step.step)
                if self.stop.is_set():
                    break
        except BaseException as e:  # noqa: BLE001 - reported in the figures
            self.errors.append(e)
        finally:
            client.close()

    def fold(self, upto: int, *, complete: bool = True) -> None:
        """Fold epochs <= `upto` (every rank is past them) into the totals."""
        for epoch in sorted(e for e in list(self.open_epochs) if e <= upto):
            counts = self.open_epochs.pop(epoch)
            self.totals["delivered"] += sum(counts.values())
            self.totals["duplicated"] += sum(n - 1 for n in counts.values())
            if complete:
                self.totals["lost"] += len(self.keys - set(counts))
                self.totals["epochs"] += 1

    # -- the run -----------------------------------------------------------------------------
    def run(self) -> dict:
        a = self.args
        duration = a.minutes * 60
        warmup = max(5.0, 0.2 * duration)
        me = Proc("trainers", os.getpid())
        self.procs.append(me)
        self.start_server()
        names = [f"r{i}" for i in range(a.readers)]
        for name in names:
            self.start_reader(name)
        threads = [threading.Thread(target=self.train, args=(r,), daemon=True)
                   for r in range(a.world_size)]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        next_fault = t0 + warmup / 2 + a.reader_restart_s
        restart_server_at = t0 + duration / 2 if a.dispatcher_restart else None
        faults: list[float] = []
        survived: list[bool | None] = []  # per fault: every rank got a new step within 30 s
        victim, generation = 1, 0
        try:
            while True:
                now = time.monotonic()
                for p in self.procs:
                    p.sample(now)
                if self.errors:
                    break
                if len(self.last_epoch) == a.world_size:
                    self.fold(min(self.last_epoch.values()) - 1)
                for i, at in enumerate(faults):
                    if survived[i] is None:
                        if all(self.last_step.get(r, 0) > at for r in range(a.world_size)):
                            survived[i] = now - at <= 30.5
                        elif now - at > 30.5:
                            survived[i] = False
                if now - t0 < duration:
                    if restart_server_at is not None and now >= restart_server_at:
                        restart_server_at = None
                        faults.append(now)
                        survived.append(None)
                        self.journal_mib["at_restart"] = self._journal_mib()
                        self.kill(self.server)
                        self.start_server()  # returns once the journal is reopened
                        self.journal_mib["after_reopen"] = self._journal_mib()
                    elif a.readers > 1 and now >= next_fault:
                        name = names[victim]
                        faults.append(now)
                        survived.append(None)
                        self.kill(self.readers[name])
                        generation += 1
                        names[victim] = f"{name.split('.')[0]}.{generation}"
                        self.start_reader(names[victim])
                        victim = victim % (a.readers - 1) + 1
                        next_fault = now + a.reader_restart_s
                elif len(self.last_epoch) == a.world_size and self._epoch_boundary_passed():
                    break
                if now - t0 > duration + 300:
                    self.errors.append(TimeoutError("no epoch boundary 300 s after the end"))
                    break
                time.sleep(0.25)
        finally:
            self.stop.set()
            end = time.monotonic()
            # Trainers first, while the stream still flows: each stops at its next step, so
            # none is cut off mid-commit by the teardown.
            for t in threads:
                t.join(15)
            for p in self.procs:
                if p.popen is not None and p.ended is None:
                    self.kill(p)
        self.journal_mib["final"] = self._journal_mib()
        self.fold(getattr(self, "_final_epoch", -1))
        self.fold(1 << 62, complete=False)  # steps past the last full epoch: counted, not audited
        return self.figures(len(faults), sum(1 for v in survived if v), warmup, end)

    def _journal_mib(self) -> float:
        """The journal directory's size (journal.mmd, the plan files, skipped.mmd)."""
        journal = os.path.join(self.tmp, "journal")
        return round(sum(os.path.getsize(os.path.join(journal, f)) for f in os.listdir(journal))
                     / 2**20, 2)

    def _epoch_boundary_passed(self) -> bool:
        if not hasattr(self, "_final_epoch"):
            self._final_epoch = max(self.last_epoch.values())
        return all(e > self._final_epoch for e in self.last_epoch.values())

    def figures(self, num_faults: int, survived: int, warmup: float, end: float) -> dict:
        rss, growth = {}, 0.0
        for p in self.procs:
            f = rss[p.name] = p.figures(warmup)
            if f["after_warmup_mib"] and f["lived_s"] >= 2 * warmup:
                g = (f["final_mib"] - f["after_warmup_mib"]) / f["after_warmup_mib"]
                f["rss_growth"] = round(g, 4)
                growth = max(growth, g)
        return {
            "minutes": self.args.minutes, "world_size": self.args.world_size,
            "readers": self.args.readers, "corpus_samples": len(self.keys),
            "epochs_completed": self.totals["epochs"],
            "samples_delivered": self.totals["delivered"],
            "samples_lost": self.totals["lost"],
            "samples_duplicated": self.totals["duplicated"],
            "faults_injected": num_faults, "faults_survived": survived,
            "rss_growth": round(growth, 4), "longest_stall_s": round(self.longest_gap, 3),
            "journal_mib": self.journal_mib,
            "errors": [repr(e)[:200] for e in self.errors], "rss": rss,
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--readers", type=int, default=3, help="reader processes (r0 is never killed)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--samples", type=int, default=480, help="corpus size (one epoch)")
    p.add_argument("--shards", type=int, default=12)
    p.add_argument("--reader-restart-s", type=float, default=15.0,
                   help="seconds between reader SIGKILL + restart")
    p.add_argument("--journal-plan-file-mb", type=int, default=16,
                   help="the dispatcher's plan file size (small: files are reused within the run)")
    p.add_argument("--dispatcher-restart", action="store_true",
                   help="also SIGKILL the dispatcher once, mid-run, and restart it from its journal")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mmdispatch-soak-") as tmp:
        out = Soak(args, tmp).run()
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            if k != "rss":
                print(f"{k:>20}  {v}")
        for name, f in out["rss"].items():
            print(f"{name:>20}  {f}")
    ok = not out["errors"] and out["samples_lost"] == 0 and out["samples_duplicated"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
