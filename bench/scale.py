"""The dispatcher against thousands of simulated ranks: its CPU per step, where it goes, and its RSS.

One real dispatcher (`mmdispatch serve --payloads reference`) serves W simulated trainer ranks:
lightweight DEALER clients without torch, many per process, that acknowledge each step the way
a trainer's client does (credit for the next steps, `received`) and, like its session, send a
heartbeat only after a second without sending anything. Simulated readers feed it
counted sample headers with reference payloads drawn from a demo-like mixture (images, audio
clips, text with a long tail), 8 samples per rank per step, M=2, 8 ranks per node. Nothing
here reads a shard: the figures are the control plane's alone.

Per W it reports sustained steps/s, the dispatcher process's CPU ms per step, split by thread
(its loop thread, the zmq I/O threads, the rest: garbage collection on a clock, the metrics
endpoint) from /proc, with a breakdown of the loop thread (`mmdispatch_loop_cpu_seconds_total`:
intake, acks, assemble, plan, journal, encode, send, and loop: polling, liveness, the window,
eviction, reader credits, bookkeeping), which adds up to that thread's CPU; peak RSS against a
stated bound, and messages and bytes per step; then a least-squares line through the
non-planning CPU per step against W.
On a small machine the simulators share the cores with the dispatcher, which lowers steps/s
but not the dispatcher's CPU per step.

    python -m bench.scale [--worlds 64 512 2560] [--seconds 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
import urllib.request

import numpy as np

from bench.machine import cpu_reference_ms
from bench.soak import _free_port
from bench.stream import RSS_PER_BUFFERED_SAMPLE_KB, _cpu_s, _rss_mb, _start_serve
from dispatcher_server.metrics import LOOP_PARTS

SAMPLES_PER_RANK = 8
RANKS_PER_NODE = 8
MICROBATCHES = 2
SHARD_SAMPLES = 4096
#: RSS bound: the dispatcher's RSS once it is READY (interpreter, libraries, the planner's compiled
#: kernels), plus a fixed margin for one step's working set and the heap's slack (plan arrays,
#: encoded messages in flight, allocator arenas), plus RSS_PER_BUFFERED_SAMPLE_KB for each sample
#: it may hold.
RSS_STEP_MB = 32.0


def _headers(rng: random.Random, n: int) -> list[tuple[int, int, list]]:
    """(text_len, llm_len, items) of `n` demo-like samples."""
    out = []
    for _ in range(n):
        text = int(min(4096, rng.lognormvariate(4.0, 1.0)))
        items = []
        u = rng.random()
        if u < 0.6:
            side = rng.choice([224, 336, 448, 672, 896])
            enc = (side // 14) ** 2
            items.append(["image", "jpg", enc, enc // 4, {}])
        elif u < 0.85:
            frames = int(rng.uniform(1.0, 30.0) * 50)
            items.append(["audio", "wav", frames, frames // 2, {}])
        out.append((text, text + sum(it[3] for it in items), items))
    return out


def reader_main(endpoint: str, seed: int, stop_at: float) -> None:
    """A simulated reader: serves its assignments from a header pool, within credits."""
    import zmq

    from dispatcher_server import protocol as P

    pool = _headers(random.Random(seed), 4096)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    P.socket_limits(sock)
    sock.connect(endpoint)
    seq = 0

    def send(type_, frames=(), **fields):
        nonlocal seq
        seq += 1
        sock.send_multipart(P.encode(type_, seq=seq, frames=frames, **fields), copy=False)

    send(P.HELLO, role="reader", name=f"sim{seed}")
    work: dict[int, list] = {}  # assign id -> [path bytes, next index, credits, ref]
    last = time.monotonic()
    k = 0
    while time.monotonic() < stop_at:
        busy = any(w[2] > 0 for w in work.values())
        if sock.poll(0 if busy else 50):
            for frames in P.pending(sock):
                msg = P.decode(frames)
                if msg.type == P.WELCOME:
                    send(P.SHARD_REQUEST, shards=4)
                elif msg.type == P.SHARD_ASSIGN:
                    path = msg["shard"].encode()
                    work[msg["assign_id"]] = [path, msg["start_index"], 0, P.pack_ref(path, 0, 1)]
                elif msg.type == P.CREDIT and msg.get("assign_id") in work:
                    work[msg["assign_id"]][2] += msg["samples"]
                elif msg.type == P.CANCEL:
                    work.pop(msg["assign_id"], None)
                elif msg.type == P.END:
                    return
        for aid, w in list(work.items()):
            n = min(w[2], 64, SHARD_SAMPLES - w[1])
            if n <= 0:
                continue
            headers, refs = [], []
            for i in range(w[1], w[1] + n):
                text, llm, items = pool[k % len(pool)]
                k += 1
                headers.append([f"{aid}-{i}", i, text, llm, P.blank_tokens(text), items])
                refs.extend([w[3]] * len(items))
            send(P.SAMPLES, frames=[b"".join(refs)], assign_id=aid, samples=headers,
                 sizes=[len(r) for r in refs])
            w[1] += n
            w[2] -= n
            if w[1] >= SHARD_SAMPLES:
                send(P.SHARD_DONE, assign_id=aid, count=SHARD_SAMPLES, skipped=[])
                del work[aid]
                send(P.SHARD_REQUEST, shards=4)
        if time.monotonic() - last > 1.0:
            send(P.HEARTBEAT)
            last = time.monotonic()
    sock.close(linger=0)


def ranks_main(endpoint: str, ranks: list[int], world: int, stop_at: float) -> None:
    """Simulated trainer ranks: acknowledge every step as DispatcherClient does (prefetch 2)."""
    import msgpack
    import zmq

    from dispatcher_server import protocol as P

    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, len(ranks) + 16)  # the default is 1023 sockets a context
    poller = zmq.Poller()
    socks = {}
    for rank in ranks:
        s = ctx.socket(zmq.DEALER)
        P.socket_limits(s)
        s.connect(endpoint)
        s.send_multipart(P.encode(P.HELLO, seq=1, role="trainer", rank=rank, world_size=world,
                                  local_world_size=RANKS_PER_NODE, next_step=None, prefetch=2))
        poller.register(s, zmq.POLLIN)
        socks[s] = rank
    last = time.monotonic()
    sent = dict.fromkeys(socks, last)  # as the client's session: a heartbeat only after 1 s idle
    while time.monotonic() < stop_at:
        for s, _ in poller.poll(100):
            for frames in P.pending(s):
                head = msgpack.unpackb(frames[0].buffer, raw=False)
                if head["type"] == P.STEP:
                    got = head["step"] + 1
                elif head["type"] == P.WELCOME:
                    got = head["next_step"]
                else:
                    continue
                s.send_multipart(P.encode(P.CREDIT, seq=2, upto=got + 2, received=got))
                sent[s] = time.monotonic()
        now = time.monotonic()
        if now - last > 0.25:
            for s in socks:
                if now - sent[s] > 1.0:
                    s.send_multipart(P.encode(P.HEARTBEAT, seq=3))
                    sent[s] = now
            last = now
    for s in socks:
        s.close(linger=0)


def _scrape(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{v}" for _, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of process `pid`'s threads so far, by group: `loop` (the main thread, which
    runs serve's loop), `zmq_io` (threads named ZMQbg*: I/O and reaper) and `other`."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"loop": 0.0, "zmq_io": 0.0, "other": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                text = f.read()
        except OSError:  # the thread ended since the listing
            continue
        comm = text[text.index("(") + 1:text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        group = ("loop" if int(tid) == pid else "zmq_io" if comm.startswith("ZMQbg")
                 else "other")
        out[group] += (int(fields[11]) + int(fields[12])) / tick
    return out


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


#: serve's default shuffle buffer: the dispatcher's cost is measured with it on
SHUFFLE = 1000


def run_world(world: int, a: argparse.Namespace, tmp: str) -> dict:
    G = SAMPLES_PER_RANK * world
    shards = []
    for i in range(64):
        path = os.path.join(tmp, f"shard-{i:04d}.tar")
        open(path, "wb").close()  # never read: references only name it
        shards.append(path)
    buffered = 6 * G + 2 * SHUFFLE  # retained steps, the step being filled, two shuffle blocks
    metrics_port = _free_port()
    proc, ready = _start_serve([
        "--shards", *shards, "--payloads", "reference", "--world-size", str(world),
        "--ranks-per-node", str(RANKS_PER_NODE), "--global-batch", str(G),
        "--num-microbatches", str(MICROBATCHES), "--max-epochs", "0",
        "--max-buffered-samples", str(buffered), "--inflight-shards", "16",
        "--shuffle-buffer", str(SHUFFLE),
        "--credit-batch", "64", "--timeout", "60", "--metrics-port", str(metrics_port),
        "--log-level", "WARNING"])
    time.sleep(0.3)  # let the interpreter settle before taking the idle RSS
    idle_rss = _rss_mb(proc.pid)
    stop_at = time.monotonic() + a.warmup_s + a.seconds + 30
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=reader_main, args=(ready["readers"], r, stop_at), daemon=True)
             for r in range(a.readers)]
    chunks = np.array_split(np.arange(world), max(1, min(a.rank_procs, world)))
    procs += [ctx.Process(target=ranks_main, args=(ready["trainers"], [int(r) for r in c], world,
                                                   stop_at), daemon=True) for c in chunks]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + a.warmup_s + 120
        while _scrape(metrics_port).get("mmdispatch_steps_served_total", 0) < a.warmup_steps:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"W={world}: the dispatcher served no {a.warmup_steps} steps")
            time.sleep(0.2)
        m0, c0, t0 = _scrape(metrics_port), _cpu_s(proc.pid), time.monotonic()
        th0 = _thread_cpu_s(proc.pid)
        time.sleep(a.seconds)
        m1, c1, t1 = _scrape(metrics_port), _cpu_s(proc.pid), time.monotonic()
        th1 = _thread_cpu_s(proc.pid)
        peak = _peak_rss_mb(proc.pid)
        dead = [p.name for p in procs if p.exitcode not in (None, 0)]
        if dead:
            raise RuntimeError(f"W={world}: simulator processes failed: {dead}")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(10)
        proc.terminate()
        proc.wait(30)
    d = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in m1}
    steps = d.get("mmdispatch_steps_served_total", 0.0)
    if steps <= 0:
        raise RuntimeError(f"W={world}: no step served in the timed window")
    per = lambda k: d.get(k, 0.0) / steps  # noqa: E731
    breakdown = {part: round(1e3 * per(f"mmdispatch_loop_cpu_seconds_total{{{part}}}"), 3)
                 for part in LOOP_PARTS}
    threads = {g: round(1e3 * (th1[g] - th0[g]) / steps, 2) for g in th1}
    return {
        "world_size": world, "samples_per_step": G, "steps": int(steps),
        "steps_per_s": round(steps / (t1 - t0), 3),
        "dispatcher_cpu_ms_per_step": round(1e3 * (c1 - c0) / steps, 2),
        # dispatcher_cpu_ms_per_step by thread (/proc, 10 ms ticks): the loop thread is what
        # breakdown_ms splits; the zmq I/O threads move the bytes
        "loop_thread_ms_per_step": threads["loop"],
        "zmq_io_ms_per_step": threads["zmq_io"],
        "other_threads_ms_per_step": threads["other"],
        "breakdown_ms": breakdown,
        "dispatcher_peak_rss_mb": round(peak, 1),
        "idle_rss_mb": round(idle_rss, 1),
        "rss_bound_mb": round(idle_rss + RSS_STEP_MB + RSS_PER_BUFFERED_SAMPLE_KB * buffered / 1024,
                              1),
        "messages_per_step": round(sum(per(f"mmdispatch_messages_total{{{d_},{r}}}")
                                       for d_ in ("in", "out") for r in ("reader", "trainer")), 1),
        "bytes_per_step": int(sum(per(f"mmdispatch_bytes_{d_}_total{{{r}}}")
                                  for d_ in ("in", "out") for r in ("reader", "trainer"))),
    }


def linear_fit(points: list[tuple[int, float]]) -> dict:
    """Least squares y = intercept + per_rank * W, with R^2 (how linear the growth is)."""
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    slope, intercept = np.polyfit(x, y, 1) if len(x) > 1 else (0.0, float(y[0]))
    fitted = intercept + slope * x
    ss = float(((y - y.mean()) ** 2).sum())
    return {"intercept_ms": round(float(intercept), 3), "per_rank_ms": round(float(slope), 5),
            "r2": round(1 - float(((y - fitted) ** 2).sum()) / ss, 4) if ss > 0 else 1.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[64, 512, 2560])
    p.add_argument("--seconds", type=float, default=20.0, help="timed window per world size")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--readers", type=int, default=2, help="simulated reader processes")
    p.add_argument("--rank-procs", type=int, default=2, help="processes hosting simulated ranks")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    worlds = {}
    with tempfile.TemporaryDirectory() as tmp:
        for w in a.worlds:
            worlds[str(w)] = run_world(w, a, tmp)
            if not a.json:
                print(json.dumps(worlds[str(w)]), file=sys.stderr)
    non_plan = [(int(w), r["dispatcher_cpu_ms_per_step"] - r["breakdown_ms"]["plan"])
                for w, r in worlds.items()]
    out = {"samples_per_rank": SAMPLES_PER_RANK, "ranks_per_node": RANKS_PER_NODE,
           "num_microbatches": MICROBATCHES, "payloads": "reference", "cpus": os.cpu_count(),
           "cpu_reference_ms": cpu_reference_ms(),
           "worlds": worlds, "non_plan_cpu_fit": linear_fit(non_plan)}
    if a.json:
        print(json.dumps(out))
    else:
        print(f"{'W':>6} {'steps/s':>8} {'cpu ms/step':>12} {'loop thr':>9} {'zmq io':>8} "
              f"{'plan':>8} {'encode':>8} {'send':>8} {'intake':>8} {'loop':>8} {'rss MB':>8} "
              f"{'bound':>8}")
        for w, r in worlds.items():
            b = r["breakdown_ms"]
            print(f"{w:>6} {r['steps_per_s']:>8.2f} {r['dispatcher_cpu_ms_per_step']:>12.1f} "
                  f"{r['loop_thread_ms_per_step']:>9.1f} {r['zmq_io_ms_per_step']:>8.1f} "
                  f"{b['plan']:>8.1f} {b['encode']:>8.1f} {b['send']:>8.1f} {b['intake']:>8.1f} "
                  f"{b['loop']:>8.1f} {r['dispatcher_peak_rss_mb']:>8.1f} "
                  f"{r['rss_bound_mb']:>8.1f}")
        print("non-planning CPU per step vs W:", out["non_plan_cpu_fit"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
