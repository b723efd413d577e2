"""Processes, corpora and audits for the fault, security and soak runs of the whole service.

Real processes (`mmdispatch serve`, `mmdispatch read`, a trainer runner below) on loopback,
each killable by signal; RSS read from /proc; an audit that checks a delivered epoch against
the corpus. Run `python -m tests.servicekit trainer ...` for a trainer process that writes
every received step as one JSON line (flushed), so a SIGKILL loses nothing already recorded.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections import Counter

from mmdispatch.serve import read_ready
from pipeline.gendata import generate
from pipeline.reader import iter_samples


# -- corpora -----------------------------------------------------------------------------------
def make_corpus(out_dir: str, *, num_copies: int, base_samples: int = 60, base_shards: int = 6,
                seed: int = 3) -> list[str]:
    """`num_copies` x `base_shards` shards: generated once, then copied with renamed keys.

    Generating real images and audio costs ~10 ms a sample; copying tar members costs ~nothing,
    so a test can afford an epoch long enough to kill things in the middle of it.
    """
    base = generate(os.path.join(out_dir, "base"), num_samples=base_samples,
                    num_shards=base_shards, seed=seed)
    paths = []
    for c in range(num_copies):
        for b, src in enumerate(base):
            dst = os.path.join(out_dir, f"c{c:02d}-{b:02d}.tar")
            with tarfile.open(src) as tin, tarfile.open(dst, "w", format=tarfile.USTAR_FORMAT) as tout:
                for info in tin.getmembers():
                    data = tin.extractfile(info).read()
                    new = tarfile.TarInfo(f"c{c:02d}x{info.name}")
                    new.size = len(data)
                    tout.addfile(new, io.BytesIO(data))
            paths.append(dst)
    return paths


def corpus_keys(shards: list[str]) -> list[str]:
    return [r.key for r in iter_samples(shards)]


# -- processes ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args: list[str], *, log: str | None = None, module: str = "mmdispatch.cli") -> subprocess.Popen:
    err = open(log, "ab") if log else subprocess.DEVNULL
    try:
        return subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE,
                                stderr=err, text=True)
    finally:
        if log:
            err.close()


def kill(proc: subprocess.Popen | None, sig: int = signal.SIGKILL) -> None:
    """SIGKILL (also a stopped process) and reap; safe to call twice."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.send_signal(sig)
        if sig == signal.SIGKILL:
            proc.wait(10)
    if sig == signal.SIGKILL and proc.stdout is not None and not proc.stdout.closed:
        proc.stdout.close()


def serve(shards: list[str] | str, *, world_size: int, extra: list[str] = (), log: str | None = None,
          global_batch: int = 8, num_microbatches: int = 2, seed: int = 5,
          timeout: float = 30.0) -> tuple[subprocess.Popen, dict]:
    """`mmdispatch serve` with test liveness settings; returns the process and its READY dict.
    `shards`: a list of shards, or the path of a dataset file."""
    what = ["--dataset", shards] if isinstance(shards, str) else ["--shards", *shards]
    args = ["serve", *what, "--world-size", str(world_size), "--global-batch",
            str(global_batch), "--num-microbatches", str(num_microbatches), "--seed", str(seed),
            "--heartbeat", "0.2", "--timeout", "1.5", "--no-fsync", *extra]
    proc = spawn(args, log=log)
    try:
        return proc, read_ready(proc.stdout, timeout)
    except BaseException:
        kill(proc)
        raise


def reader(endpoint: str, *, name: str, log: str | None = None, batch: int = 8) -> subprocess.Popen:
    return spawn(["read", "--dispatcher", endpoint, "--timeout", "1.5", "--batch", str(batch),
                  "--name", name], log=log)


def trainer(endpoint: str, rank: int, world_size: int, out: str, *, next_step: int | None = None,
            commit_every: int = 0, hold_after: int | None = None,
            log: str | None = None) -> subprocess.Popen:
    """A trainer process writing what it receives to `out`; with `hold_after` it stops taking
    steps after that one (alive, as a trainer busy training it), to be killed there."""
    args = ["trainer", endpoint, str(rank), str(world_size), out, "--commit-every",
            str(commit_every)]
    if next_step is not None:
        args += ["--next-step", str(next_step)]
    if hold_after is not None:
        args += ["--hold-after", str(hold_after)]
    return spawn(args, log=log, module="tests.servicekit")


def read_steps(path: str) -> tuple[list[tuple[int, list[list[str]]]], list[int], bool]:
    """(steps as (step, keys per micro-batch), committed steps, ended) a trainer process wrote."""
    steps, commits, ended = [], [], False
    if not os.path.exists(path):
        return steps, commits, ended
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                break  # torn by a kill
            rec = json.loads(line)
            if "step" in rec:
                steps.append((rec["step"], rec["mbs"]))
            elif "committed" in rec:
                commits.append(rec["committed"])
            elif rec.get("end"):
                ended = True
    return steps, commits, ended


def rss_bytes(pid: int) -> int:
    """Resident set size of a live process (VmRSS), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def scrape(port: int) -> dict[str, float]:
    """Prometheus text over HTTP, as {'name{labels}': value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def wait_for(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.05)


# -- a running service -------------------------------------------------------------------------
WORLD, M = 2, 2
# At most 13 samples buffered or credited per shard (shards of 60 in the fault corpus): readers
# spend their time inside a shard waiting for credit, which is where a fault hurts most. A small
# shuffle buffer keeps shuffle blocks in play across every fault.
FLOW = ["--max-buffered-samples", "96", "--credit-batch", "8", "--inflight-shards", "3",
        "--shuffle-buffer", "24",
        "--max-retained-steps", "3"]


#: Direct payloads: a dead reader's fetches move on as fast as the dispatcher notices it is gone,
#: with attempts enough to span a replacement reader's start on a loaded machine.
FETCH = {"fetch_timeout_s": 1.5, "fetch_attempts": 12}


class Stack:
    """`mmdispatch serve` plus reader processes; everything is SIGKILLed on exit."""

    def __init__(self, corpus, tmp: str, *, num_readers: int, extra=(), fixed_ports=False,
                 metrics=False, journal=False) -> None:
        self.corpus, self.tmp = corpus, tmp
        self.extra = list(FLOW) + list(extra)
        if fixed_ports:
            self.extra += ["--reader-bind", f"tcp://127.0.0.1:{free_port()}",
                           "--trainer-bind", f"tcp://127.0.0.1:{free_port()}"]
        if journal:
            self.extra += ["--journal-dir", os.path.join(tmp, "journal")]
        self.metrics = metrics
        self.log = os.path.join(tmp, "serve.log")
        self.procs: list = []
        self.names: list[str] = []
        self.num_readers = num_readers
        self.server = None

    def start_server(self) -> dict:
        extra = list(self.extra)
        if self.metrics:
            self.metrics_port = free_port()
            extra += ["--metrics-port", str(self.metrics_port)]
        self.server, self.ready = serve(self.corpus, world_size=WORLD, num_microbatches=M,
                                          extra=extra, log=self.log)
        return self.ready

    def add_reader(self, name: str):
        proc = reader(self.ready["readers"], name=name,
                        log=os.path.join(self.tmp, f"reader-{name}.log"))
        self.procs.append(proc)
        self.names.append(name)
        return proc

    def log_text(self) -> str:
        with open(self.log) as f:
            return f.read()

    def __enter__(self) -> Stack:
        self.start_server()
        try:
            for i in range(self.num_readers):
                self.add_reader(f"r{i}")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for p in [*self.procs, self.server]:
            kill(p)


# -- trainers as threads ------------------------------------------------------------------------
class Trainers:
    """One DispatcherClient per rank, each iterating in its own thread and recording every step.

    `pause` (per rank) stalls consumption while the client keeps heartbeating: a slow trainer;
    `hold()` pauses every rank and returns once none can record or commit a step, `release()`
    lets them go on. `join()` re-raises the first trainer error; clients are closed whatever
    happens.
    """

    def __init__(self, endpoint: str, world_size: int, *, commit_every: int = 0, prefetch: int = 2,
                 step_timeout_s: float = 60.0, ranks=None) -> None:
        import threading

        from trainer_client.client import ClientConfig, DispatcherClient

        ranks = list(range(world_size) if ranks is None else ranks)
        self.steps: dict[int, list] = {r: [] for r in ranks}
        self.times: dict[int, list[float]] = {r: [] for r in ranks}
        self.commits: list[int] = []
        self.errors: list[BaseException] = []
        self.pause = {r: threading.Event() for r in ranks}
        self.held = {r: threading.Event() for r in ranks}  # set while rank r sits paused
        self.stop = threading.Event()
        cfg = dict(heartbeat_s=0.2, timeout_s=1.5, step_timeout_s=step_timeout_s,
                   backoff_max_s=0.5, prefetch=prefetch, **FETCH)
        self.clients = {r: DispatcherClient(endpoint, r, world_size, world_size,
                                            config=ClientConfig(**cfg)) for r in ranks}
        self.commit_every = commit_every
        self.threads = [threading.Thread(target=self._train, args=(r,), daemon=True)
                        for r in ranks]
        for t in self.threads:
            t.start()

    def _train(self, rank: int) -> None:
        client = self.clients[rank]
        try:
            for step in client:
                self.steps[rank].append((step.step, [mb.keys for mb in step.microbatches]))
                self.times[rank].append(time.monotonic())
                if self.commit_every and (step.step + 1) % self.commit_every == 0:
                    client.commit(step.step)
                    if rank == min(self.steps):
                        self.commits.append(step.step)
                while self.pause[rank].is_set() and not self.stop.is_set():
                    self.held[rank].set()
                    time.sleep(0.01)
                self.held[rank].clear()
                if self.stop.is_set():
                    return
        except BaseException as e:  # noqa: BLE001 - re-raised by join()
            self.errors.append(e)
        finally:
            client.close()

    def hold(self, timeout: float = 30.0) -> None:
        """Pause every rank and wait until each sits paused (after the step it was on)."""
        for e in self.pause.values():
            e.set()
        deadline = time.monotonic() + timeout
        for r, e in self.held.items():
            if not e.wait(max(0.0, deadline - time.monotonic())):
                raise AssertionError(f"rank {r} did not pause within {timeout} s")

    def release(self) -> None:
        for e in self.pause.values():
            e.clear()

    def progress(self) -> int:
        """Steps every rank has received."""
        return min(len(s) for s in self.steps.values())

    def join(self, timeout: float = 60.0) -> dict[int, list]:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = any(t.is_alive() for t in self.threads)
        if alive:
            self.close()
        if self.errors:
            raise self.errors[0]
        assert not alive, "a trainer did not finish its epoch in time"
        return self.steps

    def close(self) -> None:
        self.stop.set()
        for p in self.pause.values():
            p.clear()
        for c in list(self.clients.values()):
            c.close()  # a thread blocked in next() sees its client stop and returns
        for t in self.threads:
            t.join(15)


# -- a scripted dispatcher ----------------------------------------------------------------------
class ScriptedRouter:
    """A ROUTER socket standing in for the dispatcher, on a random loopback port: the test sends
    exactly what it scripts and sees every message a reader or trainer sends (heartbeats are
    skipped unless asked for). Every receive has a timeout; use as a context manager."""

    def __init__(self) -> None:
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.ident = b""  # the sender of the last message received

    def recv(self, timeout_s: float = 5.0, *, heartbeats: bool = False):
        """The next message (a `protocol.Message`), or None if none arrives within `timeout_s`."""
        from dispatcher_server import protocol as P

        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1):
                return None
            ident, *frames = self.sock.recv_multipart()
            msg = P.decode(frames)
            if heartbeats or msg.type != P.HEARTBEAT:
                self.ident = ident
                return msg

    def expect(self, type_: str, timeout_s: float = 5.0):
        """The next message, which must be of `type_`."""
        msg = self.recv(timeout_s)
        assert msg is not None, f"no {type_} within {timeout_s} s"
        assert msg.type == type_, f"expected {type_}, got {msg.type} {msg.header}"
        return msg

    def expect_any(self, types: tuple[str, ...], timeout_s: float = 5.0):
        """The next message, which must be of one of `types`."""
        msg = self.recv(timeout_s)
        assert msg is not None, f"none of {types} within {timeout_s} s"
        assert msg.type in types, f"expected one of {types}, got {msg.type} {msg.header}"
        return msg

    def send(self, type_: str, *, ident: bytes | None = None, **fields) -> None:
        from dispatcher_server import protocol as P

        self.sock.send_multipart([self.ident if ident is None else ident, *P.encode(type_, **fields)])

    def welcome(self, hello, **fields) -> None:
        """Accept `hello` (a reader by default: heartbeats every second)."""
        fields.setdefault("role", hello["role"])
        fields.setdefault("heartbeat_s", 1.0)
        self.send("welcome", ack=hello.seq, **fields)

    def close(self) -> None:
        self.sock.close(linger=0)

    def __enter__(self) -> ScriptedRouter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tar_of(path: str, samples: list[tuple[str, dict[str, bytes]]]) -> str:
    """A shard at `path` holding `samples`, each (key, {suffix: bytes})."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, members in samples:
            for suffix, data in members.items():
                info = tarfile.TarInfo(f"{key}.{suffix}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def good_and_bad(runs: list[tuple[str, int]]) -> list[tuple[str, dict[str, bytes]]]:
    """Samples in runs of ("good" | "bad", count), keyed by their index: good ones are text,
    bad ones a zero-byte .jpg (an unreadable image)."""
    out = []
    for kind, n in runs:
        for _ in range(n):
            i = len(out)
            members = {"txt": f"sample {i} reads fine".encode()} if kind == "good" else {"jpg": b""}
            out.append((f"{i:06d}", members))
    return out


# -- the audit ---------------------------------------------------------------------------------
def audit(per_rank: dict[int, list], keys: list[str], *, num_microbatches: int,
          skipped: list[tuple[str, str]] = ()) -> None:
    """One epoch delivered: every key exactly once (or skipped, with a reason), every rank the same
    steps in order with exactly M micro-batches each, and per step disjoint key sets across ranks."""
    ranks = sorted(per_rank)
    steps = [[s for s, _ in per_rank[r]] for r in ranks]
    assert all(s == steps[0] for s in steps), "ranks received different step sequences"
    assert steps[0] == list(range(len(steps[0]))), f"steps not 0..n-1 in order: {steps[0][:20]}"
    for r in ranks:
        bad = [s for s, mbs in per_rank[r] if len(mbs) != num_microbatches]
        assert not bad, f"rank {r} got != {num_microbatches} micro-batches at steps {bad[:10]}"
    delivered = Counter(k for r in ranks for _, mbs in per_rank[r] for mb in mbs for k in mb)
    dup = sorted(k for k, n in delivered.items() if n > 1)
    assert not dup, f"{len(dup)} keys delivered twice, e.g. {dup[:5]}"
    assert all(reason for _, reason in skipped), "a skipped key without its reason"
    skipped_keys = {k for k, _ in skipped}
    assert not skipped_keys & set(delivered), "a key both skipped and delivered"
    missing = sorted(set(keys) - set(delivered) - skipped_keys)
    assert not missing, f"{len(missing)} keys lost, e.g. {missing[:5]}"
    extra = sorted(set(delivered) - set(keys))
    assert not extra, f"keys not in the corpus: {extra[:5]}"


# -- trainer process ---------------------------------------------------------------------------
def _trainer_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.servicekit trainer")
    p.add_argument("endpoint")
    p.add_argument("rank", type=int)
    p.add_argument("world_size", type=int)
    p.add_argument("out")
    p.add_argument("--next-step", type=int, default=None)
    p.add_argument("--commit-every", type=int, default=0)
    p.add_argument("--hold-after", type=int, default=None)
    a = p.parse_args(argv)
    from trainer_client.client import ClientConfig, DispatcherClient

    client = DispatcherClient(a.endpoint, a.rank, a.world_size, a.world_size, config=ClientConfig(
        heartbeat_s=0.2, timeout_s=1.5, step_timeout_s=60, backoff_max_s=0.5, **FETCH))
    if a.next_step is not None:
        client.load_state_dict({"next_step": a.next_step, "rank": a.rank,
                                "world_size": a.world_size})
    with open(a.out, "a") as out:
        print("STARTED", flush=True)
        try:
            for step in client:
                out.write(json.dumps({"step": step.step, "mbs": [mb.keys for mb in step.microbatches]})
                          + "\n")
                out.flush()
                if a.commit_every and (step.step + 1) % a.commit_every == 0:
                    client.commit(step.step)
                    out.write(json.dumps({"committed": step.step}) + "\n")
                    out.flush()
                if step.step == a.hold_after:
                    time.sleep(3600)  # killed here, its later steps received but not trained
            out.write(json.dumps({"end": True}) + "\n")
        finally:
            client.close()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["trainer"]:
        sys.exit("usage: python -m tests.servicekit trainer ENDPOINT RANK WORLD_SIZE OUT [...]")
    sys.exit(_trainer_main(sys.argv[2:]))
