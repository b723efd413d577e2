"""Every ordinary user mistake ends within seconds in one line naming the offending value.

Each case runs the real command as a subprocess, as a user would, and checks: a non-zero exit
within 10 s, no Python traceback on stderr, and the offending value (and, where one exists, the
way out) named in the message. `--debug` is the one way to get the traceback back.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MMD = [sys.executable, "-m", "mmdispatch.cli"]
TRAIN = [sys.executable, "-m", "trainer_client.train"]


@pytest.fixture(scope="module")
def held_port():
    """A TCP port some other process holds (listening), as in 'port in use'."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture(scope="module")
def files(small_shards, tmp_path_factory):
    d = tmp_path_factory.mktemp("mistakes")
    gz = d / "shard.tgz"
    import gzip

    gz.write_bytes(gzip.compress(Path(small_shards[0]).read_bytes()))
    (d / "wrong_type.toml").write_text('[serve]\nglobal_batch = "64"\n')
    (d / "unknown_key.toml").write_text("[serve]\nglobal_bach = 64\n")
    (d / "other_table.toml").write_text("[read]\nmap_shards = true\n")
    (d / "flat.toml").write_text("world_size = 4\n")
    (d / "bad_syntax.toml").write_text("[serve\n")
    (d / "train_type.toml").write_text("[train]\nsteps = 2.5\n")
    (d / "counting_type.toml").write_text('[counting]\npatch_size = "14"\n')
    (d / "counting_inf.toml").write_text("[counting]\nvideo_fps = inf\n")
    (d / "weight_inf.toml").write_text(f'[[sources]]\nname = "a"\nshards = "{small_shards[0]}"\n'
                                       "weight = inf\n")
    (d / "journal_file").write_text("not a directory")
    (d / "journal_loop").symlink_to(d / "journal_loop")
    (d / "not_a_tokenizer.json").write_text('{"not": "a tokenizer"}')
    (d / "torn_checkpoint").mkdir()
    (d / "mine").mkdir()
    (d / "mine" / "mine.tar").write_bytes(Path(small_shards[0]).read_bytes())
    (d / "torn_checkpoint" / "checkpoint.pt").write_bytes(b"PK\x03\x04 cut short")
    (d / "binary.toml").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    keys = d / "keys"
    keys.mkdir()
    (keys / "reader.key").write_text("existing")
    from dispatcher_server.security import create_keypair
    pair = d / "pair"
    create_keypair(str(pair), "dispatcher")
    # unreadable and unwritable by anyone but root (the cases run without root's overrides)
    (d / "closed").mkdir(mode=0o555)
    (d / "closed").chmod(0o555)
    (d / "hidden.key_secret").write_bytes((pair / "dispatcher.key_secret").read_bytes())
    (d / "hidden.key_secret").chmod(0)
    (d / "open.key_secret").write_bytes((pair / "dispatcher.key_secret").read_bytes())
    (d / "open.key_secret").chmod(0o666)
    leaked = d / "leaked"  # an allow-list holding a secret key file copied as NAME.key
    leaked.mkdir()
    (leaked / "peer.key").write_bytes((pair / "dispatcher.key_secret").read_bytes())
    return {"dir": d, "shard": small_shards[0], "shards_dir": str(Path(small_shards[0]).parent),
            "tgz": str(gz), "keys": str(keys), "pair": str(pair)}


SERVE_OK = ["--world-size", "2", "--global-batch", "4"]

#: id -> (argv from (files, port), words every message must contain)
CASES = {
    "missing shard": (lambda f, p: [*MMD, "serve", "--shards", "nope-000.tar", *SERVE_OK],
                      ["nope-000.tar", "does not exist"]),
    "glob matching nothing": (lambda f, p: [*MMD, "serve", "--shards", f"{f['dir']}/none-*.tar", *SERVE_OK],
                              ["none-*.tar", "no shard file matches"]),
    "world size 0": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], "--world-size", "0",
                                   "--global-batch", "4"], ["--world-size", "got 0"]),
    "world size -2": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], "--world-size", "-2",
                                    "--global-batch", "4"], ["--world-size", "got -2"]),
    "ranks per node not dividing": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], "--world-size", "6",
                                                  "--ranks-per-node", "4", "--global-batch", "4"],
                                    ["--ranks-per-node 4", "--world-size 6"]),
    "ranks per node zero": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], "--world-size", "6",
                                          "--ranks-per-node", "0", "--global-batch", "4"],
                            ["--ranks-per-node must be >= 1", "got 0"]),
    "global batch 0": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], "--world-size", "2",
                                     "--global-batch", "0"], ["--global-batch", "got 0"]),
    "unknown mode": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK, "--mode", "fast"],
                     ["'fast'", "deterministic", "arrival"]),
    "unknown oversize": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK, "--oversize", "drop"],
                         ["'drop'", "isolate"]),
    "unknown payloads": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK, "--payloads", "pigeon"],
                         ["'pigeon'", "reference", "direct"]),
    "heartbeat >= timeout": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                           "--heartbeat", "5", "--timeout", "5"],
                             ["--heartbeat 5.0", "--timeout 5.0"]),
    "reference payloads on a tgz": (lambda f, p: [*MMD, "serve", "--shards", f["tgz"], *SERVE_OK,
                                                  "--payloads", "reference"], ["shard.tgz", "inline"]),
    "reader port in use": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                         "--reader-bind", f"tcp://127.0.0.1:{p}"],
                           ["{port}", "in use", "--reader-bind"]),
    "metrics port in use": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                          "--metrics-port", str(p)], ["{port}", "--metrics-port"]),
    "metrics host not of this machine": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                                       "--metrics-port", "39917", "--metrics-host",
                                                       "10.1.2.3"],
                                         ["10.1.2.3", "give --metrics-host an address of this machine"]),
    "curve secret alone": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                         "--curve-secret", "d.key_secret"], ["--curve-allowed-dir"]),
    "curve secret a shard": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                           "--curve-secret", f["shard"], "--curve-allowed-dir", f["keys"]],
                             ["--curve-secret", "is no CurveZMQ key file", "NAME.key_secret"]),
    "curve secret the public key": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                                  "--curve-secret", f"{f['pair']}/dispatcher.key",
                                                  "--curve-allowed-dir", f["keys"]],
                                    ["--curve-secret", "dispatcher.key'", "holds no secret key",
                                     "not the public NAME.key"]),
    "curve secret missing": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                           "--curve-secret", "nope.key_secret", "--curve-allowed-dir", f["keys"]],
                             ["nope.key_secret", "keygen"]),
    "config wrong type": (lambda f, p: [*MMD, "serve", "--config", f"{f['dir']}/wrong_type.toml",
                                        "--shards", f["shard"], "--world-size", "2"],
                          ["wrong_type.toml", "[serve] global_batch", "integer", "'64'"]),
    "config unknown key": (lambda f, p: [*MMD, "serve", "--config", f"{f['dir']}/unknown_key.toml"],
                           ["unknown_key.toml", "global_bach", "global_batch"]),
    "config key of another table": (lambda f, p: [*MMD, "read", "--config", f"{f['dir']}/other_table.toml",
                                                  "--dispatcher", "tcp://127.0.0.1:9"],
                                    ["other_table.toml", "[read] map_shards", "a key of [counting]"]),
    "config flat keys": (lambda f, p: [*MMD, "read", "--config", f"{f['dir']}/flat.toml"],
                         ["flat.toml", "world_size", "[serve]"]),
    "config bad syntax": (lambda f, p: [*MMD, "serve", "--config", f"{f['dir']}/bad_syntax.toml"],
                          ["bad_syntax.toml", "TOML"]),
    "config missing": (lambda f, p: [*MMD, "serve", "--config", "nope.toml"], ["nope.toml", "does not exist"]),
    "counting config wrong type": (lambda f, p: [*MMD, "inspect", "--config", f"{f['dir']}/counting_type.toml",
                                                 f["shard"]], ["[counting] patch_size", "'14'"]),
    "tokenizer missing (inspect)": (lambda f, p: [*MMD, "inspect", f["shard"], "--tokenizer", "nope.json"],
                                    ["nope.json", "--tokenizer"]),
    "tokenizer missing (read)": (lambda f, p: [*MMD, "read", "--dispatcher", "tcp://127.0.0.1:9",
                                               "--tokenizer", "nope.json"], ["nope.json"]),
    # refused before joining a session, whose rules would keep its digest and refuse good peers
    "not a tokenizer (read)": (lambda f, p: [*MMD, "read", "--dispatcher", "tcp://127.0.0.1:9",
                                             "--tokenizer", str(f["dir"] / "not_a_tokenizer.json")],
                               ["not_a_tokenizer.json", "not an HF tokenizers JSON file"]),
    "endpoint without tcp://": (lambda f, p: [*MMD, "read", "--dispatcher", "localhost:5555", "--timeout", "1"],
                                ["localhost:5555", "tcp://HOST:PORT"]),
    # probe: these got ZeroMQ's "Invalid argument", through a worker, with no fix
    "endpoint without a port": (lambda f, p: [*MMD, "read", "--dispatcher", "tcp://localhost"],
                                ["'tcp://localhost': no port", "tcp://HOST:PORT"]),
    "endpoint a wildcard (read)": (lambda f, p: [*MMD, "read", "--dispatcher", "tcp://*:5555"],
                                   ["'tcp://*:5555'", "connect to the host the dispatcher runs on"]),
    "endpoint a wildcard (train)": (lambda f, p: [*TRAIN, "--dispatcher", "tcp://0.0.0.0:5555"],
                                    ["'tcp://0.0.0.0:5555'", "tcp://10.0.0.5:5555"]),
    "bind without tcp://": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                          "--reader-bind", "127.0.0.1:0"], ["127.0.0.1:0", "tcp://HOST:PORT"]),
    "exchange bytes 0": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                       "--exchange-bytes-per-token", "vision=0"],
                         ["--exchange-bytes-per-token 'vision=0'", "'0' is no byte count", "vision=N,audio=N"]),
    "exchange bytes of no phase": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                                 "--exchange-bytes-per-token", "llm=4"],
                                   ["'llm=4' names no encoder phase (vision, audio)"]),
    # these got ZeroMQ's "Invalid argument" or "No such device", with a fix about interfaces
    "bind without a port": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                          "--reader-bind", "tcp://127.0.0.1"],
                            ["--reader-bind 'tcp://127.0.0.1': no port", "tcp://0.0.0.0:5555"]),
    "bind a port no number": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                            "--trainer-bind", "tcp://127.0.0.1:abc"],
                              ["--trainer-bind", "port 'abc' is no number"]),
    "bind without a host": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                          "--reader-bind", "tcp://:5555"],
                            ["'tcp://:5555': no host or interface", "tcp://HOST:PORT"]),
    "read payload ports past 65535": (lambda f, p: [*MMD, "read", "--dispatcher", "tcp://127.0.0.1:9",
                                                    "--workers", "2", "--payload-bind",
                                                    "tcp://127.0.0.1:65535"],
                                      ["--payload-bind", "--workers 2", "at most 65534"]),
    "read workers 0": (lambda f, p: [*MMD, "read", "--dispatcher", "tcp://127.0.0.1:9", "--workers", "0"],
                       ["--workers", "got 0"]),
    "read read-ahead 0": (lambda f, p: [*MMD, "read", "--dispatcher", "tcp://127.0.0.1:9",
                                        "--read-ahead-mb", "0"],
                          ["--read-ahead-mb must be >= 1", "got 0"]),
    "train log a directory": (lambda f, p: [*TRAIN, "--dispatcher", "tcp://127.0.0.1:9",
                                            "--train-log", f["keys"]],
                              ["--train-log", "is a directory", "give a file path"]),
    "train log in no directory": (lambda f, p: [*TRAIN, "--dispatcher", "tcp://127.0.0.1:9",
                                                "--train-log", "/proc/nope/x.jsonl"],
                                  ["--train-log '/proc/nope/x.jsonl'", "does not exist"]),
    "gen-data into no directory": (lambda f, p: [*MMD, "gen-data", "/proc/nope"],
                                   ["output directory '/proc/nope'", "cannot be created"]),
    "read curve secret a directory": (lambda f, p: [*MMD, "read", "--dispatcher", "tcp://127.0.0.1:9",
                                                    "--curve-secret", f["keys"], "--curve-server-key",
                                                    f["keys"]],
                                      ["--curve-secret", "is a directory", "NAME.key_secret"]),
    "read curve secret missing": (lambda f, p: [*MMD, "read", "--dispatcher", "tcp://127.0.0.1:9",
                                                "--workers", "2", "--curve-secret", "nofile",
                                                "--curve-server-key", "nofile.key"],
                                  ["--curve-secret key file 'nofile' does not exist",
                                   "mmdispatch keygen NAME"]),
    # refused before the permission check (which would advise to chmod 600 a public key) and
    # before the workers start (whose line would not name the flag)
    "read curve secret the public key": (lambda f, p: [*MMD, "read", "--dispatcher", "tcp://127.0.0.1:9",
                                                       "--curve-secret", f"{f['pair']}/dispatcher.key",
                                                       "--curve-server-key", f"{f['pair']}/dispatcher.key"],
                                         ["--curve-secret", "dispatcher.key'", "holds no secret key",
                                          "not the public NAME.key"]),
    "train curve secret the public key": (lambda f, p: [*TRAIN, "--dispatcher", "tcp://127.0.0.1:9",
                                                        "--curve-secret", f"{f['pair']}/dispatcher.key",
                                                        "--curve-server-key", f"{f['pair']}/dispatcher.key"],
                                          ["--curve-secret", "dispatcher.key'", "holds no secret key"]),
    "read curve server key no key file": (lambda f, p: [*MMD, "read", "--dispatcher", "tcp://127.0.0.1:9",
                                                        "--curve-secret", f"{f['pair']}/dispatcher.key_secret",
                                                        "--curve-server-key", f"{f['keys']}/reader.key"],
                                          ["--curve-server-key", "reader.key'", "is no CurveZMQ key file",
                                           "the dispatcher's public NAME.key"]),
    "train curve server key no key file": (lambda f, p: [*TRAIN, "--dispatcher", "tcp://127.0.0.1:9",
                                                         "--curve-secret", f"{f['pair']}/dispatcher.key_secret",
                                                         "--curve-server-key", f"{f['keys']}/reader.key"],
                                           ["--curve-server-key", "reader.key'", "is no CurveZMQ key file"]),
    "ipc bind in no directory": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                               "--reader-bind", "ipc:///proc/nope/r.sock"],
                                 ["--reader-bind 'ipc:///proc/nope/r.sock'", "'/proc/nope' does not exist",
                                  "create it or give another path"]),
    "ipc trainer bind under a file": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                                    "--trainer-bind", f"ipc://{f['shard']}/t.sock"],
                                      ["--trainer-bind", "t.sock", "is not a directory"]),
    "read ipc payload bind in no directory": (lambda f, p: [*MMD, "read", "--dispatcher", "tcp://127.0.0.1:9",
                                                            "--payload-bind", "ipc:///proc/nope/p.sock"],
                                              ["--payload-bind 'ipc:///proc/nope/p.sock'",
                                               "'/proc/nope' does not exist"]),
    # 100000 forked until the host ran out of processes
    "read workers absurd": (lambda f, p: [*MMD, "read", "--dispatcher", "tcp://127.0.0.1:9",
                                          "--workers", "100000"],
                            ["--workers must be 1 to", "CPUs", "got 100000"]),
    "inspect missing shard": (lambda f, p: [*MMD, "inspect", "nope.tar"], ["nope.tar"]),
    "report missing log": (lambda f, p: [*MMD, "report", "nope.jsonl"], ["nope.jsonl", "does not exist", "--step-log"]),
    "report of a shard": (lambda f, p: [*MMD, "report", f["tgz"]], ["shard.tgz", "binary", "--step-log"]),
    "keygen over an existing key": (lambda f, p: [*MMD, "keygen", "reader", "--dir", f["keys"]],
                                    ["reader.key", "--force"]),
    "gen-data without samples": (lambda f, p: [*MMD, "gen-data", f"{f['dir']}/gen", "--samples", "0"],
                                 ["--samples 0"]),
    "read batch 0": (lambda f, p: [*MMD, "read", "--dispatcher", "tcp://127.0.0.1:9", "--batch", "0"],
                     ["--batch", "got 0"]),
    "bind port out of range": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                             "--reader-bind", "tcp://127.0.0.1:99999"],
                               ["--reader-bind", "99999", "65535"]),
    "dispatcher port out of range": (lambda f, p: [*MMD, "read", "--dispatcher", "tcp://127.0.0.1:70000"],
                                     ["--dispatcher", "70000", "65535"]),
    "metrics port out of range": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                                "--metrics-port", "70000"], ["--metrics-port", "70000"]),
    "blend weight inf": (lambda f, p: [*MMD, "inspect", "--dataset", f"{f['dir']}/weight_inf.toml"],
                         ["weight_inf.toml", "sources[0].weight", "inf"]),
    "capacity factor nan": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                          "--llm-capacity-factor", "nan"], ["--llm-capacity-factor", "'nan'"]),
    "probe timeout inf": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                        "--probe-timeout-s", "inf"], ["--probe-timeout-s", "'inf'"]),
    "audio rate inf": (lambda f, p: [*MMD, "inspect", f["shard"], "--audio-frames-per-s", "inf"],
                       ["--audio-frames-per-s", "'inf'"]),
    "counting config inf": (lambda f, p: [*MMD, "inspect", "--config", f"{f['dir']}/counting_inf.toml",
                                          f["shard"]], ["counting_inf.toml", "[counting] video_fps", "inf"]),
    "max header pixels 0": (lambda f, p: [*MMD, "inspect", f["shard"], "--max-header-pixels", "0"],
                            ["--max-header-pixels 0"]),
    "read pixel budget below 1": (lambda f, p: [*MMD, "read", "--dispatcher", "tcp://127.0.0.1:9",
                                                "--min-pixels", "0"], ["--min-pixels 0", "--max-pixels"]),
    "video pixel budget below 1": (lambda f, p: [*MMD, "inspect", f["shard"], "--video-max-pixels", "0"],
                                   ["--video-max-pixels 0", "under one 28x28 patch group"]),
    # Qwen's "768 (x 28 x 28)" token budget given as pixels: every frame was one token, silently
    "video pixel budget in tokens": (lambda f, p: [*MMD, "inspect", f["shard"], "--video-max-pixels", "768"],
                                     ["--video-max-pixels 768", "784 pixels", "pixels per sampled frame",
                                      "602112"]),
    "read malloc keep past a C int": (lambda f, p: [*MMD, "read", "--dispatcher", "tcp://127.0.0.1:9",
                                                    "--malloc-keep-mb", "1024"],
                                      ["--malloc-keep-mb", "0 to 1023", "got 1024"]),
    "world size past the planner's": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], "--global-batch", "4",
                                                    "--world-size", str(10**8)],
                                      ["--world-size", "1 to 65536", f"got {10**8}"]),
    "micro-batches past the planner's": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], "--world-size", "1",
                                                       "--global-batch", str(10**8), "--max-buffered-samples",
                                                       str(10**9), "--num-microbatches", str(10**8)],
                                         ["--num-microbatches", "1 to 65536", f"got {10**8}"]),
    "ranks x micro-batches past the planner's": (lambda f, p: [*MMD, "serve", "--shards", f["shard"],
                                                               "--world-size", "65536", "--global-batch", "65536",
                                                               "--max-buffered-samples", str(10**6),
                                                               "--num-microbatches", "2048"],
                                                 ["--world-size 65536 x --num-microbatches 2048",
                                                  "lower --num-microbatches"]),
    "more micro-batches than samples": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                                      "--num-microbatches", "1000"],
                                        ["--num-microbatches 1000", "--global-batch 4"]),
    "bind address not of this machine": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                                       "--reader-bind", "tcp://10.1.2.3:0"],
                                         ["--reader-bind", "10.1.2.3", "an address or interface of this machine",
                                          "tcp://0.0.0.0:PORT"]),
    "bind host that does not resolve": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                                      "--trainer-bind", "tcp://no-such-host.invalid:5555"],
                                        ["--trainer-bind", "no-such-host.invalid",
                                         "an address or interface of this machine", "tcp://0.0.0.0:PORT"]),
    "bind with another scheme": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                               "--trainer-bind", "http://127.0.0.1:5"],
                                 ["--trainer-bind", "not http", "tcp://HOST:PORT"]),
    "reader and trainer binds on one port": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                                       "--reader-bind", "tcp://127.0.0.1:45871",
                                                       "--trainer-bind", "tcp://127.0.0.1:45871"],
                                             ["--reader-bind and --trainer-bind both name port 45871"]),
    "metrics port on a bind's port": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                                    "--trainer-bind", "tcp://127.0.0.1:45872",
                                                    "--metrics-port", "45872"],
                                      ["--trainer-bind and --metrics-port both name port 45872"]),
    "journal dir cannot be created": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                                    "--journal-dir", "/proc/nope/journal"],
                                      ["--journal-dir", "/proc/nope/journal", "cannot be created"]),
    "keygen dir a file": (lambda f, p: [*MMD, "keygen", "x", "--dir", f"{f['dir']}/journal_file"],
                          ["--dir", "journal_file", "is a file"]),
    "journal dir a symlink loop": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                                 "--journal-dir", f"{f['dir']}/journal_loop"],
                                   ["--journal-dir", "journal_loop", "is a symbolic link that leads",
                                    "Too many levels of symbolic links"]),
    "journal dir is a file": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                            "--journal-dir", f"{f['dir']}/journal_file"],
                              ["--journal-dir", "journal_file", "not a directory"]),
    "train config wrong type": (lambda f, p: [*TRAIN, "--config", f"{f['dir']}/train_type.toml",
                                              "--dispatcher", "tcp://127.0.0.1:9"],
                                ["train_type.toml", "[train] steps", "2.5"]),
    "train curve key alone": (lambda f, p: [*TRAIN, "--dispatcher", "tcp://127.0.0.1:9", "--curve-secret", "x"],
                              ["--curve-secret is given without --curve-server-key", "public NAME.key"]),
    "read curve server key alone": (lambda f, p: [*MMD, "read", "--dispatcher", "tcp://127.0.0.1:9",
                                                  "--curve-server-key", "x.key"],
                                    ["--curve-server-key is given without --curve-secret"]),
    "train steps negative": (lambda f, p: [*TRAIN, "--dispatcher", "tcp://127.0.0.1:9", "--steps", "-1"],
                             ["--steps", "got -1"]),
    "train prefetch 0": (lambda f, p: [*TRAIN, "--dispatcher", "tcp://127.0.0.1:9", "--prefetch", "0"],
                         ["--prefetch", "got 0"]),
    "train prefetch past the cap": (lambda f, p: [*TRAIN, "--dispatcher", "tcp://127.0.0.1:9",
                                                  "--prefetch", "5000"], ["--prefetch", "at most 4096", "got 5000"]),
    "train unknown exchange": (lambda f, p: [*TRAIN, "--dispatcher", "tcp://127.0.0.1:9", "--exchange", "ring"],
                               ["'ring'", "two_stage"]),
    "train unknown backend": (lambda f, p: [*TRAIN, "--dispatcher", "tcp://127.0.0.1:9", "--backend", "pigeon"],
                              ["--backend 'pigeon'", "gloo"]),
    "train learning rate negative": (lambda f, p: [*TRAIN, "--dispatcher", "tcp://127.0.0.1:9", "--lr", "-1"],
                                     ["--lr", "> 0", "got -1.0"]),
    "train malloc keep past a C int": (lambda f, p: [*TRAIN, "--dispatcher", "tcp://127.0.0.1:9",
                                                     "--malloc-keep-mb", "1024"],
                                       ["--malloc-keep-mb", "0 to 1023", "0 = off", "got 1024"]),
    "train malloc keep negative": (lambda f, p: [*TRAIN, "--dispatcher", "tcp://127.0.0.1:9",
                                                 "--malloc-keep-mb", "-1"],
                                   ["--malloc-keep-mb", "0 to 1023", "got -1"]),
    "train progress every negative": (lambda f, p: [*TRAIN, "--dispatcher", "tcp://127.0.0.1:9",
                                                    "--progress-every", "-1"], ["--progress-every", "got -1.0"]),
    "train outside torchrun": (lambda f, p: [*TRAIN, "--dispatcher", "tcp://127.0.0.1:9"],
                               ["RANK", "torchrun", "MASTER_PORT"]),
    "train checkpoint dir a file": (lambda f, p: [*TRAIN, "--dispatcher", "tcp://127.0.0.1:9",
                                                  "--checkpoint-dir", f"{f['dir']}/journal_file"],
                                    ["--checkpoint-dir", "journal_file", "is a file"]),
    "train checkpoint torn": (lambda f, p: [*TRAIN, "--dispatcher", "tcp://127.0.0.1:9",
                                            "--checkpoint-dir", f"{f['dir']}/torn_checkpoint"],
                              ["checkpoint.pt", "cannot be loaded", "remove it"]),
    "config not UTF-8 (serve)": (lambda f, p: [*MMD, "serve", "--config", f"{f['dir']}/binary.toml"],
                                 ["binary.toml", "not UTF-8"]),
    "config not UTF-8 (read)": (lambda f, p: [*MMD, "read", "--config", f"{f['dir']}/binary.toml"],
                                ["binary.toml", "not UTF-8"]),
    "config not UTF-8 (inspect)": (lambda f, p: [*MMD, "inspect", "--config", f"{f['dir']}/binary.toml",
                                                 f["shard"]], ["binary.toml", "not UTF-8"]),
    "dataset not UTF-8": (lambda f, p: [*MMD, "inspect", "--dataset", f"{f['dir']}/binary.toml"],
                          ["binary.toml", "not UTF-8"]),
    "max retained steps 0": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                           "--max-retained-steps", "0"], ["--max-retained-steps", ">= 1", "got 0"]),
    "inflight shards 0": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK, "--inflight-shards", "0"],
                          ["--inflight-shards", ">= 1", "got 0"]),
    "credit batch 0": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK, "--credit-batch", "0"],
                       ["--credit-batch", ">= 1", "got 0"]),
    "journal plan file 0 MB": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                             "--journal-plan-file-mb", "0"], ["--journal-plan-file-mb", "got 0"]),
    "max steps 0": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK, "--max-steps", "0"],
                    ["--max-steps", ">= 1", "got 0"]),
    "max epochs negative": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK, "--max-epochs", "-1"],
                            ["--max-epochs", ">= 0", "got -1"]),
    "max buffered bytes 0": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                           "--max-buffered-bytes", "0"], ["--max-buffered-bytes", ">= 1", "got 0"]),
    "max buffered samples too few": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                                   "--max-buffered-samples", "0"],
                                     ["--max-buffered-samples 0", "(--max-retained-steps + 1) * --global-batch"]),
    "llm capacity factor below 1": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                                  "--llm-capacity-factor", "0.5"],
                                    ["--llm-capacity-factor", "0 (no limit)", "got 0.5"]),
    "token budget past 64 bits": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                                "--token-budget", str(2**64)], ["--token-budget", "2**63 - 1"]),
    "read pixel budget past 64 bits": (lambda f, p: [*MMD, "read", "--dispatcher", "tcp://127.0.0.1:9",
                                                     "--max-pixels", str(2**64)],
                                       ["--max-pixels", str(2**64), "64 bits"]),
    "train hidden size past 64 bits": (lambda f, p: [*TRAIN, "--dispatcher", "tcp://127.0.0.1:9",
                                                     "--hidden", str(2**63)], ["--hidden", "64 bits"]),
    "train hidden size odd": (lambda f, p: [*TRAIN, "--dispatcher", "tcp://127.0.0.1:9", "--hidden", "3"],
                              ["--hidden must be a multiple of 2", "attention heads", "got 3"]),
    "seed past 64 bits": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK, "--seed", str(2**64)],
                          ["--seed", "64 bits"]),
    "max buffered samples past 64 bits": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                                        "--max-buffered-samples", str(2**64)],
                                          ["--max-buffered-samples", "at most 2**63 - 1", f"got {2**64}"]),
    "llm capacity factor past its range": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                                         "--llm-capacity-factor", "1e20"],
                                           ["--llm-capacity-factor", "from 1 to 1000000", "got 1e+20"]),
    "world size past 64 bits": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], "--global-batch", "4",
                                              "--world-size", str(2**64)], ["--world-size", "2**63 - 1"]),
    "io threads past ZeroMQ's": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                               "--io-threads", str(2**31)], ["--io-threads", "from 1 to 64"]),
    "malloc keep past a C int": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                               "--malloc-keep-mb", str(2**31)], ["--malloc-keep-mb", "0 to 1023"]),
    "probe timeout past a thread's wait": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                                         "--probe-timeout-s", "1e300"],
                                           ["--probe-timeout-s", "at most", "got 1e+300"]),
    "malloc keep negative": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                           "--malloc-keep-mb", "-1"], ["--malloc-keep-mb", ">= 0", "got -1"]),
    "step log is a directory": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                              "--step-log", str(f["dir"])], ["--step-log", "is a directory"]),
    "gen-data seed negative": (lambda f, p: [*MMD, "gen-data", f"{f['dir']}/gen", "--seed", "-1"],
                               ["--seed", "got -1"]),
    "gen-data into a file": (lambda f, p: [*MMD, "gen-data", f"{f['dir']}/journal_file"],
                             ["journal_file", "not a directory"]),
    "demo on files but no shards or dataset.toml": (lambda f, p: [*MMD, "demo", "--data", f["keys"],
                                                                  "--reports", f"{f['dir']}/reports"],
                                                    ["--data", "no dataset.toml and no shards",
                                                     "reader.key", "new or empty directory"]),
    "gen-data beside other shards": (lambda f, p: [*MMD, "gen-data", f"{f['dir']}/mine"],
                                     ["mine.tar", "did not write", "new or empty directory"]),
    "calibrate runs below the fit's least": (lambda f, p: [*MMD, "calibrate", "--runs", "2"],
                                             ["--runs must be >= 4", "got 2"]),
    "calibrate runs 0": (lambda f, p: [*MMD, "calibrate", "--runs", "0"], ["--runs must be >= 4", "got 0"]),
    # refused before the measurement, not after it
    "calibrate out unwritable": (lambda f, p: [*MMD, "calibrate", "--out", "/proc/nope/x.json"],
                                 ["--out '/proc/nope/x.json'", "'/proc/nope' does not exist"]),
    "report out unwritable": (lambda f, p: [*MMD, "report", "nope.jsonl", "--out", "/proc/nope/x.png"],
                              ["--out '/proc/nope/x.png'", "'/proc/nope'", "cannot be created"]),
    "report out not a figure format": (lambda f, p: [*MMD, "report", "nope.jsonl", "--out", "x.txt"],
                                       ["--out 'x.txt'", ".txt is no figure format", ".png", ".svg"]),
    "demo data unwritable": (lambda f, p: [*MMD, "demo", "--data", "/proc/nope"],
                             ["--data '/proc/nope'", "cannot be created"]),
    "demo reports unwritable": (lambda f, p: [*MMD, "demo", "--reports", "/proc/nope"],
                                ["--reports '/proc/nope'", "cannot be created"]),
    "gen-data video share past 1": (lambda f, p: [*MMD, "gen-data", f"{f['dir']}/vs", "--video-share", "1.5"],
                                    ["--video-share", "from 0 to 1", "got 1.5"]),
    "gen-data blend in fewer shards than sources": (lambda f, p: [*MMD, "gen-data", f"{f['dir']}/bl", "--blend",
                                                                  "--samples", "5", "--shards", "2"],
                                                    ["--blend writes 3 sources", "--shards must be >= 3",
                                                     "got 2"]),
    "curve allowed dir holds a secret key": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                                           "--curve-secret", f"{f['pair']}/dispatcher.key_secret",
                                                           "--curve-allowed-dir", f"{f['dir']}/leaked"],
                                             ["--curve-allowed-dir", "peer.key", "holds a secret key",
                                              "mmdispatch keygen"]),
    "curve allowed dir is a file": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                                  "--curve-secret", f"{f['keys']}/reader.key",
                                                  "--curve-allowed-dir", f"{f['keys']}/reader.key"],
                                    ["--curve-allowed-dir", "reader.key", "is a file, not a directory"]),
    "inspect json field empty": (lambda f, p: [*MMD, "inspect", f["shard"], "--json-field", ""],
                                 ["--json-field ''", "is empty"]),
    "serve both of an exclusive pair": (lambda f, p: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                                      "--num-microbatches", "2", "--microbatch-token-budget", "9"],
                                        ["--num-microbatches 2 and --microbatch-token-budget 9",
                                         "both on the command line"]),
    # --timeout 5 and a small dataset: without the check, the demo still ends (and stops its
    # children) before the test's own timeout
    "demo without readers": (lambda f, p: [*MMD, "demo", "--data", f"{f['dir']}/demo", "--reports",
                                           f"{f['dir']}/reports", "--samples", "24", "--shards", "3",
                                           "--timeout", "5", "--readers", "0"], ["--readers", "got 0"]),
}


#: id -> (argv from files, words every message must contain): mistakes of permissions, run by
#: a user without root's overrides of file modes
UNPRIVILEGED = {
    "journal dir not writable": (lambda f: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                            "--journal-dir", f"{f['dir']}/closed"],
                                 ["--journal-dir", "closed'", "cannot be written", "Permission denied",
                                  "give a directory the dispatcher can write"]),
    "step log in a directory not writable": (lambda f: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                                        "--step-log", f"{f['dir']}/closed/steps.jsonl"],
                                             ["--step-log", "steps.jsonl", "cannot be written",
                                              "Permission denied"]),
    "curve secret not readable": (lambda f: [*MMD, "serve", "--shards", f["shard"], *SERVE_OK,
                                             "--curve-secret", f"{f['dir']}/hidden.key_secret",
                                             "--curve-allowed-dir", f["keys"]],
                                  ["--curve-secret", "hidden.key_secret", "cannot be read",
                                   "Permission denied"]),
    "keygen dir not writable": (lambda f: [*MMD, "keygen", "x", "--dir", f"{f['dir']}/closed"],
                                ["--dir", "closed'", "cannot be written", "Permission denied",
                                 "give a directory this user can write"]),
}

_NO_OVERRIDES = "--drop=cap_dac_override,cap_dac_read_search,cap_fowner"


def _unprivileged(argv: list[str], files) -> list[str]:
    """`argv` run without root's overrides of file modes (as root: under capsh); skips where
    that cannot be had."""
    import os
    import shutil

    if os.geteuid() != 0:
        return argv
    capsh = shutil.which("capsh")
    if capsh is None:
        pytest.skip("root without capsh: file modes cannot be made to refuse")
    wrapped = [capsh, _NO_OVERRIDES, "--", "-c", 'exec "$@"', "capsh"]
    probe = subprocess.run([*wrapped, "test", "-w", f"{files['dir']}/closed"], capture_output=True)
    if probe.returncode != 1:
        pytest.skip("capsh cannot drop root's overrides of file modes here")
    return [*wrapped, *argv]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(UNPRIVILEGED))
def test_a_file_this_user_may_not_use_is_one_line_naming_the_flag(case, files):
    make_argv, words = UNPRIVILEGED[case]
    out = _run(_unprivileged(make_argv(files), files))
    assert out.returncode != 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    message = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(message) == 1, out.stderr
    assert "[Errno" not in message[0], message[0]
    for word in words:
        assert word in message[0], message[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["serve", "read", "train"])
def test_a_secret_key_every_user_can_read_is_warned_of_once(command, files):
    """Each command that loads a secret key says once that others can read it (the mistake
    after it stops the command before it connects or binds)."""
    secret, public = f"{files['dir']}/open.key_secret", f"{files['pair']}/dispatcher.key"
    argv = {"serve": [*MMD, "serve", "--shards", files["shard"], *SERVE_OK, "--curve-secret", secret,
                      "--curve-allowed-dir", files["keys"], "--heartbeat", "0"],
            "read": [*MMD, "read", "--dispatcher", "tcp://127.0.0.1:9", "--curve-secret", secret,
                     "--curve-server-key", public, "--timeout", "0"],
            "train": [*TRAIN, "--dispatcher", "tcp://127.0.0.1:9", "--curve-secret", secret,
                      "--curve-server-key", public, "--steps", "-1"]}[command]
    out = _run(argv)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    warned = [line for line in out.stderr.splitlines() if "curve_secret_readable" in line]
    assert len(warned) == 1 and f"chmod 600 {secret}" in warned[0], out.stderr


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    """The command's result; a command that waits on a peer or a timeout instead of refusing
    the mistake at once runs into `timeout` and fails the test."""
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=30,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(CASES))
def test_mistake_ends_in_one_line_naming_the_value(case, files, held_port):
    make_argv, words = CASES[case]
    out = _run(make_argv(files, held_port))
    assert out.returncode != 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    message = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(message) == 1, out.stderr
    assert "usage:" not in out.stderr, out.stderr  # the mistake, not 35 lines of usage above it
    # found before the planner's warm-up (20 s on a fresh machine): binds, keys, the journal
    # and the shards' probe come first
    assert "planner_ready" not in out.stderr, out.stderr
    for word in words:
        assert word.replace("{port}", str(held_port)) in message[0], message[0]


@pytest.mark.timeout(90)
def test_a_serve_that_fails_to_start_does_not_hold_the_corrected_one_back(files, held_port, tmp_path):
    """A refused flag leaves no journal directory; a start that fails once its journal exists
    (the port in use) leaves only its configuration, which the corrected start takes over."""
    journal = tmp_path / "runs" / "journal"
    serve = [*MMD, "serve", "--shards", files["shard"], "--world-size", "2", "--journal-dir", str(journal)]
    out = _run([*serve, "--global-batch", "4", "--heartbeat", "0"])
    assert out.returncode == 2 and "--heartbeat 0" in out.stderr
    assert not (tmp_path / "runs").exists()
    out = _run([*serve, "--global-batch", "4", "--trainer-bind", f"tcp://127.0.0.1:{held_port}"])
    assert out.returncode == 2 and "in use" in out.stderr and journal.is_dir()
    proc = subprocess.Popen([*serve, "--global-batch", "8"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    try:
        ready = proc.stdout.readline()
    finally:
        proc.terminate()
        err = proc.communicate(timeout=30)[1]
    assert ready.startswith("READY"), err
    assert "recorded no step" in err
    assert "event=stopped reason=SIGTERM next_step=0" in err  # a planned stop says so


@pytest.mark.timeout(60)
def test_train_backend_that_cannot_carry_the_cpu_model_is_named_with_the_fix():
    """The reference model and its gradients live on CPU: under NCCL its first collective
    failed, or, where torch had no NCCL, init_process_group did."""
    for backend in ("nccl", "cuda:nccl"):
        out = _run([*TRAIN, "--dispatcher", "tcp://127.0.0.1:9", "--backend", backend])
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert f"--backend '{backend}'" in out.stderr and "runs its model on CPU" in out.stderr
        assert "--backend gloo" in out.stderr, out.stderr
    out = _run([*TRAIN, "--dispatcher", "tcp://127.0.0.1:9", "--backend", "cpu:pigeon"])
    assert "this torch has no 'pigeon' backend" in out.stderr, out.stderr
    import torch

    if not torch.cuda.is_available():  # the per-device form reached torch's own NCCL refusal
        out = _run([*TRAIN, "--dispatcher", "tcp://127.0.0.1:9", "--backend", "cuda:nccl,cpu:gloo"])
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert "NCCL needs GPUs and this machine has none" in out.stderr, out.stderr


@pytest.mark.timeout(60)
def test_debug_brings_the_traceback_back(files):
    out = _run([*MMD, "serve", "--debug", "--shards", "nope-000.tar", *SERVE_OK])
    assert out.returncode != 0 and "Traceback" in out.stderr and "nope-000.tar" in out.stderr


def _help(command: str) -> str:
    from mmdispatch.cli import build_parser

    return " ".join(build_parser(command).format_help().split())


def test_keygen_help_says_what_keygen_does_not_what_its_module_does():
    text = _help("keygen")
    assert "Create a CurveZMQ key pair" in text and "NAME.key_secret" in text
    assert "apply CurveZMQ to the sockets" not in text and "(`mmdispatch keygen`)" not in text


def test_help_shows_choices_and_no_meaningless_defaults():
    serve = _help("serve")
    for flag, choices in (("--mode", "{deterministic,arrival}"), ("--oversize", "{error,isolate}"),
                          ("--payloads", "{inline,reference,direct}")):
        assert f"{flag} {choices}" in serve
    assert "pipe:" in serve and "file:" in serve  # the shard URL forms --shards accepts
    for command in ("serve", "read", "inspect"):
        text = _help(command)
        assert "(default: None)" not in text and "(default: True)" not in text and "(default: False)" not in text
        assert text.count("(default: text, caption, conversations, messages)") == (command != "serve")
        assert "(default: text, caption, conversations, messages) (default" not in text
    report = _help("report")
    assert "--train-log" in report and "trainer's --log" not in report


#: --help sections of `mmdispatch serve`, each holding some of its ~50 options
SERVE_SECTIONS = ("data and dataset", "batch and planning", "readers and buffering", "network and security",
                  "journal and fault tolerance", "run length", "observability", "logging and errors")


def test_serve_help_groups_its_options_and_drops_none():
    from mmdispatch.cli import build_parser
    from mmdispatch.serve import OPTIONS

    section, shown = None, {}
    for line in build_parser("serve").format_help().splitlines():
        if re.fullmatch(r"\S.*:", line):
            section = line[:-1]
        elif m := re.match(r"  (-[-\w]+)", line):
            assert m[1] not in shown, f"{m[1]} listed twice"
            shown[m[1]] = section
    flags = {"--" + dest.replace("_", "-") for dest in OPTIONS}
    assert set(shown) == flags | {"-h", "--config", "--log-format", "--debug"}
    assert {f for f, s in shown.items() if s == "options"} == {"-h", "--config"}
    assert set(shown.values()) == {"options", *SERVE_SECTIONS}
    assert shown["--world-size"] == "batch and planning" and shown["--journal-dir"] == "journal and fault tolerance"
    assert shown["--log-level"] == shown["--log-format"] == "logging and errors"


#: every numeric counting option of `read` and `inspect` -> a value out of its range
COUNTING_MISTAKES = {
    "--min-pixels": "0", "--max-pixels": "0", "--patch-size": "0", "--merge-size": "0",
    "--max-header-pixels": "0", "--video-fps": "0", "--video-min-frames": "0", "--video-max-pixels": "0",
    "--audio-frames-per-s": "0", "--audio-tokens-per-s": "-1", "--audio-pad-window": "0",
    "--max-text-bytes": "0", "--max-member-bytes": "0", "--max-consecutive-errors": "0",
    "--max-seq-len": "0", "--max-clip-seconds": "0",
}


def _counting_parser() -> argparse.ArgumentParser:
    from pipeline.reader import add_reader_arguments

    parser = argparse.ArgumentParser()
    add_reader_arguments(parser)
    return parser


def test_every_numeric_counting_option_has_a_mistake_case():
    from dispatcher_server.cliopts import finite_float

    numeric = {a.option_strings[0] for a in _counting_parser()._actions if a.type in (int, finite_float)}
    assert numeric == set(COUNTING_MISTAKES)


@pytest.mark.parametrize("flag", list(COUNTING_MISTAKES))
def test_counting_option_out_of_range_is_named_by_its_flag(flag):
    """The config classes name their fields (`min_pixels=0`); read and inspect say the flag."""
    from pipeline.reader import reader_config_from_args

    with pytest.raises(ValueError) as e:
        reader_config_from_args(_counting_parser().parse_args([flag, COUNTING_MISTAKES[flag]]))
    message = str(e.value)
    assert flag in message and not re.search(r"[a-z]=", message), message


def _trainer_counting_flags() -> list[str]:
    from trainer_client.options import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return [a.option_strings[0] for a in parser._actions if a.option_strings
            and a.option_strings[0] in COUNTING_MISTAKES]


@pytest.mark.parametrize("flag,value", [*((f, COUNTING_MISTAKES[f]) for f in _trainer_counting_flags()),
                                        ("--audio-frames-per-s", "30")])
def test_a_trainer_counting_option_out_of_range_is_named_by_its_flag(flag, value):
    """The trainer takes the readers' counting options and says them the same way, including
    an audio rate its mel frames cannot be pooled to (30/s: not 100/k)."""
    from trainer_client.options import add_arguments, preprocess_config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError) as e:
        preprocess_config_from_args(parser.parse_args(["--dispatcher", "tcp://127.0.0.1:9", flag, value]))
    message = str(e.value)
    assert f"{flag} " in message and not re.search(r"[a-z]=", message), message


@pytest.mark.timeout(90)
def test_a_checkpoint_of_another_model_shape_is_one_line_naming_the_flags(tmp_path):
    """Resumed with --hidden other than the checkpoint's: torch's size-mismatch traceback was
    all the user saw."""
    import socket

    import torch

    from trainer_client.model import ModelConfig, ReferenceModel
    from trainer_client.train import save_checkpoint

    model = ReferenceModel(ModelConfig.tiny(hidden=32))
    save_checkpoint(str(tmp_path), {"model": model.state_dict(),
                                    "optimizer": torch.optim.AdamW(model.parameters()).state_dict(),
                                    "data": {"next_step": 0}})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    out = subprocess.run([*TRAIN, "--dispatcher", "tcp://127.0.0.1:9", "--hidden", "16",
                          "--checkpoint-dir", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    (line,) = [x for x in out.stderr.splitlines() if "error:" in x]
    assert "was saved for another model" in line and "--hidden" in line and "size mismatch" in line


@pytest.mark.timeout(120)
def test_a_trainer_stopped_with_sigterm_says_bye():
    """torchrun, Kubernetes and compose stop trainers with SIGTERM: the trainer died where the
    signal found it, and the dispatcher noticed only at its timeout."""
    import signal
    import socket
    import time

    from dispatcher_server import protocol as P
    from tests.servicekit import ScriptedRouter

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    with ScriptedRouter() as router:
        proc = subprocess.Popen([*TRAIN, "--dispatcher", router.endpoint], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            hello = router.expect(P.HELLO, 60.0)
            router.welcome(hello, role="trainer", world_size=1, next_step=0, num_microbatches=1,
                           payloads="inline")
            time.sleep(1.0)  # welcomed: the loop waits for its first step
            proc.send_signal(signal.SIGTERM)
            bye, deadline = None, time.monotonic() + 10
            while bye is None and time.monotonic() < deadline:  # credits come first
                msg = router.recv(1.0)
                bye = msg if msg is not None and msg.type == P.BYE else None
            _, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
            proc.wait(10)
    assert bye is not None and proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err, err


@pytest.mark.timeout(240)
@pytest.mark.parametrize("argv", [
    [*MMD, "read", "--dispatcher", "tcp://127.0.0.1:9"],
    [*MMD, "serve", "--shards", "nope-000.tar", *SERVE_OK],
    [*TRAIN, "--dispatcher", "tcp://127.0.0.1:9"],
], ids=["read", "serve", "train"])
def test_ctrl_c_during_start_up_is_one_quiet_line(argv):
    """A Ctrl-C while the command still imported its libraries or parsed its options printed
    a KeyboardInterrupt traceback: main() did that outside run_reporting_errors."""
    import signal
    import time

    for delay in (0.15, 0.3, 0.6, 1.2):  # the interpreter, the imports, the parsing
        # As from a terminal: SIGINT at its default. A test run in the background of a
        # non-interactive shell (`make test &`) ignores SIGINT, the command inherits that, and a
        # Ctrl-C landing between start-up and the reader's own handler was ignored for good.
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, (delay, err)
        if proc.returncode == 130:
            assert err.strip().endswith(": interrupted") and len(err.strip().splitlines()) <= 1, err


@pytest.mark.timeout(300)
def test_ctrl_c_while_read_starts_its_workers_is_one_quiet_line():
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) while `read --workers N`
    started its worker processes printed a worker's traceback: KeyboardInterrupt inside an
    import of the new interpreter. Once every worker reads, it stops them as before (status 0)."""
    import os
    import signal
    import time

    from tests.servicekit import wait_for
    from tests.test_session import _workers_of

    argv = [*MMD, "read", "--dispatcher", "tcp://127.0.0.1:9", "--connect-timeout", "60", "--workers", "2"]
    codes = []
    for delay in (0.0, 0.2, 0.6, 1.5, 3.0):  # after the first worker process appeared
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
        try:
            wait_for(lambda: _workers_of(proc.pid), 60, "a worker process")
            time.sleep(delay)
            os.killpg(proc.pid, signal.SIGINT)
            _, err = proc.communicate(timeout=90)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        lines = err.strip().splitlines()
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, (delay, err)
        assert proc.returncode in (0, 130), (delay, proc.returncode, err)
        if proc.returncode == 130:
            assert lines[-1] == "mmdispatch read: interrupted" and err.count("interrupted") == 1, (delay, err)
        assert all("event=stopped" in line for line in lines[:-1 if proc.returncode else None]), (delay, err)
        codes.append(proc.returncode)
    assert codes[0] == 130  # a worker just started still imports: the window was hit


@pytest.mark.parametrize("command,flags", [
    ("serve", ["--token-budget", "--llm-capacity", "--max-steps", "--step-log", "--journal-dir"]),
    ("read", ["--audio-pad-window"]), ("inspect", ["--audio-pad-window"]), ("report", ["--json"]),
    ("train", ["--audio-pad-window"]),
])
def test_an_option_without_a_default_value_says_what_unset_means(command, flags):
    """Their help (and docs/configuration.md's Default column) said nothing of what leaving
    them out does."""
    if command == "train":
        from trainer_client.train import build_parser as train_parser
        parser = train_parser()
    else:
        from mmdispatch.cli import build_parser
        parser = build_parser(command)
    helps = {s: a.help for a in parser._actions for s in a.option_strings}
    for flag in flags:
        assert "default: " in helps[flag], (flag, helps[flag])


def test_a_sigterm_while_the_interpreter_waits_for_threads_exits_143_without_a_traceback(tmp_path):
    """torchrun tears down ranks with SIGTERM; one arriving after the main thread's code ended,
    while the interpreter waited for a non-daemon thread, raised SystemExit inside
    `threading._shutdown`: "Exception ignored in: <module 'threading'>", a traceback, and the
    process went on waiting (status 0). It exits with 143 at once now, saying nothing more."""
    script = tmp_path / "late_sigterm.py"
    script.write_text(
        "import os, signal, threading, time\n"
        "from dispatcher_server.cliopts import unwind_on_sigterm\n"
        "unwind_on_sigterm()\n"
        "def late():\n"
        "    time.sleep(0.5)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(30)\n"
        "threading.Thread(target=late).start()\n")
    root = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 143, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr


@pytest.mark.timeout(60)
def test_a_command_needing_an_extra_not_installed_names_the_extra(tmp_path):
    """`mmdispatch calibrate` on an install without torch (`pip install mmdispatch`) ended in a
    traceback; it names the extra to install, in one line, exit status 2 (probe)."""
    (tmp_path / "torch").mkdir()  # torch as an install without it has it: not there at all
    (tmp_path / "torch" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    out = subprocess.run([*MMD, "calibrate", "--out", str(tmp_path / "cost.json")], cwd=ROOT,
                         capture_output=True, text=True, timeout=30,
                         env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip() == ("mmdispatch calibrate: error: this needs torch, which is not "
                                  "installed: pip install 'mmdispatch[trainer]' (pick its wheel "
                                  "index as in the README)"), out.stderr


def test_exchange_bytes_per_token_reach_the_planner():
    from dispatcher_server.planner import DEFAULT_BYTES_PER_TOKEN, PlannerConfig
    from mmdispatch.serve import exchange_bytes

    assert exchange_bytes(None) == {} and exchange_bytes("5120") == {"vision": 5120, "audio": 5120}
    assert exchange_bytes("audio=2048, vision=5120") == {"audio": 2048, "vision": 5120}
    config = PlannerConfig(num_microbatches=1, bytes_per_token=exchange_bytes("audio=2048"))  # as serve
    assert (config.bytes_for("audio"), config.bytes_for("vision")) == (2048, DEFAULT_BYTES_PER_TOKEN)
