"""End-to-end streaming throughput: shards -> R readers -> dispatcher -> W trainers, vs a bare read.

Every party is a real process on 127.0.0.1. The baseline, in the same run, is a bare webdataset
read of the same shards by R processes (no counting, no planning, no sockets). Rates are taken
between the first and the last sample seen by the consuming processes (process start-up is
excluded on both sides). A second phase makes one trainer slow and records the dispatcher's
peak RSS against its configured bound.

    python -m bench.stream [--json]

Every payload mode runs (`--payloads all`, the default), alternating with the bare read:
`inline` (members travel reader -> dispatcher -> trainer), `direct` (trainers fetch the members
from the readers that counted them; the dispatcher carries metadata) and `reference` (trainers
read the members from the shard files). The headline keys are the last mode run (`reference`);
each mode's full figures are under its name.

CPU per sample is reported per party over the timed window (from the first step a trainer gets
to the end; start-up and imports excluded, as for the bare read): dispatcher and readers from
/proc (zmq I/O threads included), trainers from their own process time. On a small machine the
ratio is bounded by the total CPU the chain spends per sample against the bare read
(`e2e_vs_raw_cpu_bound`): with R = cores, the bare read owns every core while the chain's
7 processes share them.

Per party (`e2e_cpu_ms_per_sample`, beside `raw_cpu_ms_per_sample`; docs/benchmarks.md has the
stored figures), readers spend about what the bare read does (tar reading and header counting from mapped shards, then
building and sending SAMPLES messages), plus, with direct payloads, serving the trainers'
fetches; the dispatcher's cost does not depend on the payload bytes except inline, where every
payload byte crosses a second TCP hop; trainers spend least with mapped reference payloads and
more when they copy them (`--trainer-reads copy`), receive them inline or fetch them from the
readers. Beyond CPU, the ratio needs the chain never to wait on itself: readers hold their next
shard queued (no round trip per shard) and the dispatcher keeps serve's window of 8 shards and
4 retained steps. Neither side decodes: the bare read collects each member as a bytes object (a
copy), the trainers take their payloads (mapped views by default, copies with
`--trainer-reads copy`) and count their bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from dispatcher_server.protocol import PAYLOAD_MODES

MiB = 1 << 20
#: What each sample the dispatcher may hold costs beside its payload bytes: Python objects
#: (header record, key, item records, payload views) and its share of retained messages.
RSS_PER_BUFFERED_SAMPLE_KB = 2.0


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _cpu_s(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


class ProcSampler:
    """Every 20 ms from /proc: the dispatcher's peak RSS, and the CPU seconds of each process.

    CPU is kept as a time series so it can be read over the same window as the rates: from the
    first step a trainer got to the end (start-up and imports excluded, as for the bare read).
    """

    def __init__(self, server_pid: int) -> None:
        self.pid, self.peak = server_pid, 0.0
        self.groups: dict[str, list[int]] = {}
        self.series: dict[int, list[tuple[float, float]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss_mb(self.pid))
            now = time.time()
            for pid in [self.pid, *(p for g in self.groups.values() for p in g)]:
                t = _cpu_s(pid)
                if t is not None:
                    self.series.setdefault(pid, []).append((now, t))

    def stop(self, since: float) -> tuple[float, dict[str, float]]:
        """Peak RSS, and CPU seconds per group from time `since` to the last reading."""
        self._stop.set()
        self._thread.join(5)
        groups = {"dispatcher": [self.pid], **self.groups}
        cpu = {}
        for g, pids in groups.items():
            total = 0.0
            for pid in pids:
                series = self.series.get(pid, [])
                before = [c for t, c in series if t <= since]
                if series:
                    total += series[-1][1] - (before[-1] if before else 0.0)
            cpu[g] = total
        return self.peak, cpu


# -- worker roles (run as subprocesses of this module) -----------------------------------------
def raw_worker(shards: list[str], epochs: int) -> dict:
    import webdataset as wds

    print("READY", flush=True)
    sys.stdin.readline()  # start together: imports are not part of the measurement
    n = nbytes = 0
    t_first, cpu0 = time.time(), time.process_time()
    for _ in range(epochs):
        for sample in wds.WebDataset(shards, shardshuffle=False, empty_check=False):
            nbytes += sum(len(v) for v in sample.values() if isinstance(v, bytes))
            n += 1
    return {"samples": n, "bytes": nbytes, "t_first": t_first, "t_last": time.time(),
            "cpu_s": time.process_time() - cpu0}


def trainer_worker(address: str, rank: int, world_size: int, slow_ms: float, map_shards: bool) -> dict:
    from trainer_client.client import ClientConfig, DispatcherClient

    n = nbytes = steps = 0
    t_first = None
    client = DispatcherClient(address, rank, world_size, world_size,
                              config=ClientConfig(prefetch=2, step_timeout_s=300,
                                                  map_shards=map_shards)).start()
    import torch

    # torch initialises its op dispatch on first use (~0.5 s CPU); do it before the clock runs.
    torch.cumsum(torch.frombuffer(bytearray(16), dtype=torch.int64), 0)
    print("READY", flush=True)  # connected: readers start only now, so nothing is pre-buffered
    cpu0 = t_last = None
    try:
        for step in client:
            if t_first is None:
                t_first, cpu0 = time.time(), time.process_time()
            for mb in step.microbatches:
                n += len(mb.keys)
                nbytes += sum(5 * t.numel() for t in mb.text_ids)  # int32 id + mask byte each
                for enc in mb.encoders.values():
                    nbytes += sum(p.nbytes for p in enc.payloads)
            steps += 1
            if slow_ms:
                time.sleep(slow_ms / 1e3)
        t_last, cpu_s = time.time(), time.process_time() - cpu0  # the stream ended (END)
    finally:
        client.close()
    return {"samples": n, "bytes": nbytes, "steps": steps, "t_first": t_first, "t_last": t_last,
            "cpu_s": cpu_s}


def _spawn(args: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True,
                            stdin=subprocess.PIPE, stderr=(errors := tempfile.TemporaryFile("w+")))
    proc.errors = errors  # read back if the worker fails
    return proc


def _wait_ready(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        line = p.stdout.readline()
        if line.strip() != "READY":
            raise RuntimeError(f"worker {p.args} did not start: {line!r}")


def _collect(procs: list[subprocess.Popen], timeout: float) -> list[dict]:
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=timeout)
        if p.returncode != 0:
            p.errors.seek(0)
            raise RuntimeError(f"worker {p.args} failed with status {p.returncode}: "
                               f"{p.errors.read()[-2000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _rate(results: list[dict]) -> tuple[float, float, int, int]:
    span = max(r["t_last"] for r in results) - min(r["t_first"] for r in results)
    n = sum(r["samples"] for r in results)
    b = sum(r["bytes"] for r in results)
    return n / span, b / span / MiB, n, b


def run_raw(shards: list[str], num_procs: int, epochs: int) -> dict:
    procs = [_spawn(["-m", "bench.stream", "--role", "raw", "--epochs", str(epochs),
                     "--worker-shards", *shards[i::num_procs]]) for i in range(num_procs)]
    _wait_ready(procs)
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    results = _collect(procs, 600)
    rate, mbps, n, _ = _rate(results)
    cpu = sum(r["cpu_s"] for r in results)
    return {"samples_per_s": rate, "mb_per_s": mbps, "samples": n,
            "cpu_ms_per_sample": round(1e3 * cpu / n, 3)}


def _start_serve(args: list[str]) -> tuple[subprocess.Popen, dict]:
    from mmdispatch.serve import parse_ready  # the planner's imports, in this process only
    errors = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-m", "mmdispatch.cli", "serve", *args],
                            stdout=subprocess.PIPE, stderr=errors, text=True)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if sel.select(0.2):
            line = proc.stdout.readline()
            ready = parse_ready(line)
            if ready is not None:
                proc.errors = errors  # read back if the run fails
                return proc, ready
            if not line:
                break
    proc.kill()
    proc.wait(10)
    errors.seek(0)
    raise RuntimeError("dispatcher did not start: " + errors.read()[-2000:])


def run_e2e(shards: list[str], a: argparse.Namespace, slow_ms: float, payloads: str = "inline") -> dict:
    # The trainers all run on this host and say LOCAL_WORLD_SIZE = trainers: plan for one node.
    serve_args = ["--shards", *shards, "--world-size", str(a.trainers),
                  "--ranks-per-node", str(a.trainers), "--global-batch",
                  str(a.global_batch), "--num-microbatches", str(a.microbatches),
                  "--max-epochs", str(a.epochs), "--exit-when-done", "--log-level", "WARNING",
                  "--max-buffered-samples", str(a.max_buffered_samples),
                  "--max-buffered-bytes", str(a.max_buffered_mb * MiB),
                  "--max-retained-steps", str(a.retained_steps),
                  "--inflight-shards", str(a.inflight_shards),
                  "--credit-batch", str(a.credit_batch), "--io-threads", str(a.io_threads),
                  "--payloads", payloads]
    if a.transport == "ipc":  # same-host peers over Unix sockets (an option; TCP is the default)
        ipc_dir = tempfile.mkdtemp(prefix="mmdispatch-ipc-")
        serve_args += ["--reader-bind", f"ipc://{ipc_dir}/readers",
                       "--trainer-bind", f"ipc://{ipc_dir}/trainers"]
    server, ready = _start_serve(serve_args)
    time.sleep(0.3)  # let the interpreter settle before taking the idle RSS
    sampler = ProcSampler(server.pid)
    idle_rss = _rss_mb(server.pid)
    trainers = [_spawn(["-m", "bench.stream", "--role", "trainer", "--address", ready["trainers"],
                        "--rank", str(r), "--trainers", str(a.trainers),
                        "--slow-ms", str(slow_ms if r == 0 else 0),
                        "--trainer-reads", a.trainer_reads]) for r in range(a.trainers)]
    _wait_ready(trainers)
    # One process per reader worker, so each one's CPU time can be read from /proc.
    t_spawn = time.time()
    readers = [subprocess.Popen([sys.executable, "-m", "mmdispatch.cli", "read", "--dispatcher",
                                 ready["readers"], "--workers", "1", "--batch", str(a.reader_batch)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for _ in range(a.readers)]
    sampler.groups = {"readers": [p.pid for p in readers]}
    results = []
    try:
        results = _collect(trainers, 900)
        server.wait(60)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        server.errors.seek(0)
        raise RuntimeError(f"{e}\ndispatcher (exit status {server.poll()}): "
                           f"{server.errors.read()[-2000:]}") from e
    finally:
        peak, cpu = sampler.stop(min((r["t_first"] for r in results), default=0.0))
        for p in (*readers, server, *trainers):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    rate, mbps, n, _ = _rate(results)
    # Trainers report their own CPU from their first step to their last (their interpreter
    # shutdown, ~0.5 s of torch teardown, is not streaming work); the others are read from /proc.
    cpu["trainers"] = sum(r["cpu_s"] for r in results)
    return {"samples_per_s": rate, "mb_per_s": mbps, "samples": n, "idle_rss_mb": idle_rss,
            "samples_per_s_from_spawn": n / (max(r["t_last"] for r in results) - t_spawn),
            "peak_rss_mb": peak, "steps": results[0]["steps"],
            "cpu_ms_per_sample": {g: round(1e3 * t / n, 3) for g, t in cpu.items()}}


def _median(values: list[float]) -> float:
    return statistics.median(values)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--samples", type=int, default=3200)
    p.add_argument("--shards", type=int, default=32)
    p.add_argument("--readers", type=int, default=2)
    p.add_argument("--trainers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--repeat", type=int, default=5, help="raw/e2e trios; medians are reported")
    p.add_argument("--global-batch", type=int, default=512)
    p.add_argument("--microbatches", type=int, default=2)
    # Reference-mode samples are ~1 KB in the dispatcher: the bytes bound is what caps memory.
    p.add_argument("--max-buffered-samples", type=int, default=8192)
    p.add_argument("--max-buffered-mb", type=int, default=96)
    p.add_argument("--credit-batch", type=int, default=128, help="samples per reader credit")
    p.add_argument("--reader-batch", type=int, default=128, help="most samples per SAMPLES message")
    p.add_argument("--io-threads", type=int, default=2, help="dispatcher ZeroMQ I/O threads")
    p.add_argument("--transport", choices=("tcp", "ipc"), default="tcp",
                   help="how readers and trainers reach the dispatcher on this host")
    p.add_argument("--inflight-shards", type=int, default=8, help="reorder window (serve's default)")
    p.add_argument("--payloads", choices=(*PAYLOAD_MODES, "all"), default="all",
                   help="payload mode(s) of the e2e runs (serve --payloads)")
    p.add_argument("--retained-steps", type=int, default=4, help="serve's default")
    p.add_argument("--trainer-reads", choices=("map", "copy"), default="map",
                   help="reference payloads in the trainers: views of the mapped shard files, or "
                        "copies read with preadv (ClientConfig.map_shards)")
    p.add_argument("--skip-raw", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--slow-ms", type=float, default=100.0, help="per-step delay of the slow trainer")
    p.add_argument("--data", default=None, help="reuse/generate shards here (default: temp dir)")
    # worker roles
    p.add_argument("--role", choices=("raw", "trainer"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-shards", nargs="*", default=[], help=argparse.SUPPRESS)
    p.add_argument("--address", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.role == "raw":
        print(json.dumps(raw_worker(a.worker_shards, a.epochs)))
        return 0
    if a.role == "trainer":
        print(json.dumps(trainer_worker(a.address, a.rank, a.trainers, a.slow_ms,
                                        a.trainer_reads == "map")))
        return 0

    from pipeline.gendata import generate

    tmp = None
    if a.data is None:
        tmp = tempfile.TemporaryDirectory(prefix="mmdispatch-bench-")
        a.data = tmp.name
    shards = sorted(os.path.join(a.data, f) for f in os.listdir(a.data) if f.endswith(".tar")) \
        if os.path.isdir(a.data) else []
    if len(shards) != a.shards:
        shards = generate(a.data, num_samples=a.samples, num_shards=a.shards, seed=0)
    # Raw and e2e runs alternate, so each trio sees the same background load on a shared
    # machine; ratios are medians of the per-trio ratios, rates and CPU figures are medians.
    # reference last: the headline keys stay the mode they have always been
    modes = ("inline", "direct", "reference") if a.payloads == "all" else (a.payloads,)
    raws, e2es = [], {m: [] for m in modes}
    for _ in range(a.repeat):
        raws.append(run_raw(shards, a.readers, a.epochs) if not a.skip_raw else
                    {"samples_per_s": float("nan"), "mb_per_s": float("nan"), "samples": 0,
                     "cpu_ms_per_sample": None})
        for m in modes:
            e2es[m].append(run_e2e(shards, a, 0.0, m))
    raw = {k: _median([r[k] for r in raws]) for k in ("samples_per_s", "mb_per_s")}
    raw.update(samples=raws[0]["samples"], cpu_ms_per_sample=_median(
        [r["cpu_ms_per_sample"] for r in raws]) if not a.skip_raw else None)
    per_mode = {}
    for m in modes:
        runs = e2es[m]
        ratios = [e["samples_per_s"] / r["samples_per_s"] for e, r in zip(runs, raws)]
        cpu = {g: round(_median([e["cpu_ms_per_sample"][g] for e in runs]), 3)
               for g in runs[0]["cpu_ms_per_sample"]}
        per_mode[m] = {
            "e2e_samples_per_s": round(_median([e["samples_per_s"] for e in runs]), 1),
            "e2e_vs_raw": round(_median(ratios), 3),
            "e2e_vs_raw_runs": [round(r, 3) for r in ratios],
            "payload_mb_per_s": round(_median([e["mb_per_s"] for e in runs]), 2),
            "e2e_samples_delivered": runs[0]["samples"],
            "e2e_cpu_ms_per_sample": cpu,
            # Where both sides are CPU-bound on the same cores, the ratio tends to this.
            "e2e_vs_raw_cpu_bound": (round(raw["cpu_ms_per_sample"] / sum(cpu.values()), 3)
                                     if raw["cpu_ms_per_sample"] else None),
            "dispatcher_peak_rss_mb": round(max(e["peak_rss_mb"] for e in runs), 1),
        }
    slow = run_e2e(shards, a, a.slow_ms, "inline")  # inline: where payloads fill its memory
    # The bound the configuration promises: the idle process plus the buffered payload, twice
    # (received frames and the send queues referencing them can briefly coexist), plus the
    # objects of the most samples it may hold (max_buffered_samples).
    rss_bound = (slow["idle_rss_mb"] + 2 * a.max_buffered_mb
                 + RSS_PER_BUFFERED_SAMPLE_KB * a.max_buffered_samples / 1024)
    head = per_mode[modes[-1]]
    out = {
        "readers": a.readers, "trainers": a.trainers, "cpus": os.cpu_count(),
        "samples_per_epoch": a.samples, "epochs": a.epochs, "global_batch": a.global_batch,
        "config": {"transport": a.transport, "ranks_per_node": a.trainers,
                   "num_microbatches": a.microbatches, "reader_batch": a.reader_batch,
                   "credit_batch": a.credit_batch, "io_threads": a.io_threads,
                   "inflight_shards": a.inflight_shards,
                   "max_buffered_samples": a.max_buffered_samples,
                   "retained_steps": a.retained_steps, "prefetch": 2,
                   "trainer_reads": a.trainer_reads,
                   "payload_frames": "coalesced (protocol v3)", "malloc_keep_mb": 16,
                   "repeat": a.repeat},
        # Headline figures: the last mode run (`reference` when all are), each mode in full below.
        "payloads": modes[-1],
        "e2e_samples_per_s": head["e2e_samples_per_s"],
        "raw_samples_per_s": round(raw["samples_per_s"], 1),
        "e2e_vs_raw": head["e2e_vs_raw"],
        "payload_mb_per_s": head["payload_mb_per_s"],
        "raw_mb_per_s": round(raw["mb_per_s"], 2),
        "raw_samples_read": raw["samples"],
        "raw_cpu_ms_per_sample": raw["cpu_ms_per_sample"],
        **{f"{m}": v for m, v in per_mode.items()},
        "dispatcher_peak_rss_mb": max(v["dispatcher_peak_rss_mb"] for v in per_mode.values()),
        "slow_trainer_ms_per_step": a.slow_ms,
        "slow_samples_per_s": round(slow["samples_per_s"], 1),
        "slow_dispatcher_peak_rss_mb": round(slow["peak_rss_mb"], 1),
        "max_buffered_mb": a.max_buffered_mb,
        "rss_bound_mb": round(rss_bound, 1),
        "rss_within_bound": slow["peak_rss_mb"] <= rss_bound,
    }
    if tmp is not None:
        tmp.cleanup()
    if a.json:
        print(json.dumps(out))
    else:
        width = max(map(len, out))
        for k, v in out.items():
            print(f"{k:<{width}}  {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
