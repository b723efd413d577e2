"""Run the dispatcher: collect counts from readers, plan every step, stream each rank its part.

Settings come from the `[serve]` table of a TOML file (`--config`, keys named like the options
below with underscores; `mmdispatch.settings`) and flags, flags winning. Once bound and its planner loaded, one line `READY {json}` on stdout
gives the bound endpoints (peers may connect as soon as `event=bound` is logged; bind to port 0 to let the OS pick; under `--log-format json` a JSON object with
`"event": "ready"`), then structured log lines go to stderr.
"""

from __future__ import annotations

import argparse
import copy
import errno
import json
import logging
import math
import os
import selectors
import signal
import sys
import threading
import time

import zmq

from dispatcher_server.cliopts import (
    LOG_LEVELS, LOGGING_GROUP, MAX_MALLOC_KEEP_MB, add_config_argument, check_endpoint,
    check_ipc_bind, check_tcp_bind, finite_float, json_line, named_by_flags, say, setup_logging,
    unwind_on_sigterm,
)
from dispatcher_server.config import (
    MODES, BatchConfig, CurveConfig, FlowConfig, LivenessConfig, ServerConfig, Source,
)
from dispatcher_server.costfile import load_cost_file
from dispatcher_server.planner import PlannerConfig, Topology
from dispatcher_server.planner.config import DEFAULT_LLM_CAPACITY_FACTOR, OVERSIZE_POLICIES
from dispatcher_server.planner.types import ENCODER_PHASES
from dispatcher_server.planner.warm import warm_up
from dispatcher_server.protocol import PAYLOAD_MODES
from dispatcher_server.security import check_allowed_keys, load_secret, warn_if_readable
from dispatcher_server.tuning import collect_on_a_clock, keep_freed_memory
from dispatcher_server.halt import HaltedJob
from dispatcher_server.measure import RefitConfig
from dispatcher_server.metrics import event
from dispatcher_server.server import LOST_RANK_GRACE_S, Dispatcher
from mmdispatch.dataset import load_dataset
from pipeline.shards import absolute_url, expand_shards

#: dest -> (flag type, default, help). Defaults live here, not in argparse, so TOML can fill gaps.
OPTIONS: dict[str, tuple[object, object, str]] = {
    "shards": (str, None, "shard specs: paths, directories, globs, {000..009} ranges, file: and "
                          "pipe: URLs, s3:// gs:// http(s):// URLs (the [cloud] extra; credentials "
                          "from AWS_*/GOOGLE_* variables; docs/datasets.md) (one source; or --dataset)"),
    "dataset": (str, None, "dataset file (TOML): sources with shards, blend weights and field "
                           "maps, see docs/datasets.md (instead of --shards)"),
    "shuffle_buffer": (int, 1000, "samples per seeded shuffle block, shared by the sources by "
                                  "weight; 0 = each source in shard order (a dataset file's "
                                  "shuffle_buffer wins over this default)"),
    "shuffle_shards": (int, 1, "shards each shuffle block draws from side by side (deterministic "
                               "mode); 1 = one after another, so a block, and its steps, holds "
                               "one or two shards when shards are as large as it; needs as many "
                               "reader slots per source"),
    "seed": (int, 0, "seed of the shard orders, the blend and the shuffle"),
    "mode": (str, "deterministic", "deterministic (order fixed by shards+seed+epoch) or arrival"),
    "world_size": (int, None, "data-parallel ranks (trainers); required"),
    "ranks_per_node": (int, 1, "consecutive ranks per node (LOCAL_WORLD_SIZE)"),
    "global_batch": (int, None, "samples per step; required"),
    "token_budget": (int, None, "also cut a step at this many LLM tokens (default: unset, a step is "
                                     "--global-batch samples whatever their tokens); a sample "
                                     "over it is a step of its own"),
    "num_microbatches": (int, None, "micro-batches per step per rank (default 1 unless "
                                    "--microbatch-token-budget is set)"),
    "microbatch_token_budget": (int, None, "derive M from LLM tokens per rank per micro-batch "
                                           "(M stops at samples per rank): it sets M, it does not "
                                           "cap a micro-batch (--llm-capacity does)"),
    "llm_capacity": (int, None, "LLM tokens per rank per micro-batch (default: unset, derived "
                                 "from --llm-capacity-factor)"),
    "llm_capacity_factor": (finite_float, DEFAULT_LLM_CAPACITY_FACTOR,
                            "without --llm-capacity, each rank's micro-batch holds at most this "
                            "many times the step's mean LLM tokens per rank and micro-batch (at "
                            "least its longest sample), so M micro-batches need about the memory "
                            "of an even split; 0 = no limit (the planner may then run a rank's "
                            "whole share in one micro-batch)"),
    "oversize": (str, "error", "samples over capacity: error or isolate"),
    "cost_model": (str, None, "cost file written by 'mmdispatch calibrate' (default: FLOP-formula costs)"),
    "exchange_bytes_per_token": (str, None, "bytes of one encoder output token the trainers "
                                 "exchange (output width x dtype bytes: 5120 for a 2560-wide "
                                 "bf16 output), as N or per phase as vision=N,audio=N; it sizes "
                                 "the exchange bytes plans predict and the step log and report "
                                 "show (default: unset, 8192 each: a 4096-wide bf16 output)"),
    "max_buffered_samples": (int, 4096, "samples the dispatcher may hold, credits included"),
    "max_buffered_bytes": (int, 256 << 20, "bytes held (payloads, and 768 a sample item for its "
                           "header and view) after which reader credits stop, and no "
                           "further step is planned while the steps not yet acknowledged hold "
                           "that much (one always may be); a "
                           "shuffle block is emitted whole, so with --shuffle-buffer the bound is "
                           "at least one block of each source (about --shuffle-buffer samples)"),
    "max_retained_steps": (int, 4, "steps sent but not yet acknowledged by every rank (fewer "
                           "while they hold --max-buffered-bytes)"),
    "inflight_shards": (int, 8, "shards read at once (deterministic reorder window)"),
    "credit_batch": (int, 32, "samples per reader credit grant"),
    "heartbeat": (finite_float, 1.0, "heartbeat interval, seconds"),
    "timeout": (finite_float, 5.0, "peer silence before it is considered gone, seconds"),
    "max_shard_losses": (int, 3, "readers lost in a row while reading one shard at the same "
                                 "sample before that sample is skipped (readers_lost, logged by "
                                 "shard and index) rather than take down every reader in turn"),
    "reader_bind": (str, "tcp://127.0.0.1:0", "endpoint readers connect to"),
    "trainer_bind": (str, "tcp://127.0.0.1:0", "endpoint trainers connect to"),
    "journal_dir": (str, None, "journal directory (enables exact, checked resume; default: "
                                 "unset, no journal: trainers restored from a checkpoint resume "
                                 "at their step by planning the data again from its start, "
                                 "exact only if no shard and no reader rule changed: nothing "
                                 "checks them)"),
    "no_fsync": (bool, False, "skip fsync of journal records (tests only)"),
    "journal_plan_file_mb": (int, 64, "size at which the journal's plan file being written hands "
                                      "over to the other (disk: about twice this)"),
    "metrics_port": (int, 0, "Prometheus HTTP port; 0 = off"),
    "metrics_host": (str, "127.0.0.1", "address the metrics endpoint binds"),
    "step_log": (str, None, "append one JSON line per planned step (plan vs random baseline; a step "
                 "planned again after a restart or rewind adds a line, the last is its plan), and "
                 "the trainers' measured phase times (\"kind\": \"measure\"); default: unset, no step log"),
    "payloads": (str, "inline", "inline: member bytes flow reader -> dispatcher -> trainer; "
                                "reference: only their offsets do, and trainers read the bytes "
                                "from the shard files (same paths on every host, plain tars); "
                                "direct: only their offsets do, and trainers fetch the bytes from "
                                "the readers (plain tars, local or on s3://, gs://, http(s)://; "
                                "see read --payload-bind)"),
    "probe_samples": (int, 64, "at start, read up to this many samples of the first shards and "
                               "refuse a dataset in which none has a member the field map uses "
                               "(0 = no probe)"),
    "probe_timeout_s": (finite_float, 30.0, "seconds the start-up probe may take; past them (a shard "
                                     "command or server that does not answer) serving starts "
                                     "unprobed, with a warning"),
    "curve_secret": (str, None, "require CurveZMQ: the dispatcher's NAME.key_secret"),
    "curve_allowed_dir": (str, None, "require CurveZMQ: directory of allowed public keys"),
    "max_epochs": (int, 1, "epochs to serve; 0 = unbounded"),
    "max_steps": (int, None, "stop after this many steps (default: unset, when the data ends "
                                "after --max-epochs)"),
    "exit_when_done": (bool, False, "exit once every rank got the end of the stream"),
    "refit": (bool, False, "refit the cost model online from the trainers' measured phase times "
                           "(the last 512 runs per phase, every 20 steps; each change is logged)"),
    "io_threads": (int, 2, "ZeroMQ I/O threads: 2 lets reader and trainer traffic move in parallel"),
    "malloc_keep_mb": (int, 16, "reuse freed heap blocks up to this size instead of fresh pages "
                                "(glibc; saves page faults on payload frames); 0 = off"),
    "log_level": (str, "INFO", "logging level"),
}


#: dest -> the values an option accepts (shown in --help, checked by argparse and the file schema)
CHOICES: dict[str, tuple[str, ...]] = {
    "mode": MODES, "oversize": OVERSIZE_POLICIES, "payloads": PAYLOAD_MODES, "log_level": LOG_LEVELS,
}


#: --help section -> the OPTIONS shown in it, in order; every option in exactly one
GROUPS: dict[str, tuple[str, ...]] = {
    "data and dataset": ("shards", "dataset", "shuffle_buffer", "shuffle_shards", "seed", "mode", "payloads",
                         "probe_samples", "probe_timeout_s"),
    "batch and planning": ("world_size", "ranks_per_node", "global_batch", "token_budget",
                           "num_microbatches", "microbatch_token_budget", "llm_capacity",
                           "llm_capacity_factor", "oversize", "cost_model",
                           "exchange_bytes_per_token", "refit"),
    "readers and buffering": ("max_buffered_samples", "max_buffered_bytes", "max_retained_steps",
                              "inflight_shards", "credit_batch", "malloc_keep_mb"),
    "network and security": ("reader_bind", "trainer_bind", "heartbeat", "timeout", "io_threads",
                             "curve_secret", "curve_allowed_dir"),
    "journal and fault tolerance": ("journal_dir", "no_fsync", "journal_plan_file_mb",
                                    "max_shard_losses"),
    "run length": ("max_epochs", "max_steps", "exit_when_done"),
    "observability": ("metrics_port", "metrics_host", "step_log"),
    LOGGING_GROUP: ("log_level",),  # beside --log-format and --debug
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    grouped = [dest for dests in GROUPS.values() for dest in dests]
    assert sorted(grouped) == sorted(OPTIONS), "each serve option belongs to one --help section"
    add_config_argument(parser)
    for title, dests in GROUPS.items():
        group = parser.add_argument_group(title)
        for dest in dests:
            _add_option(group, dest)


class _GivenOnce(argparse.Action):
    """A flag that takes one value: given twice, the first would be dropped without a word."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} is given twice ({getattr(namespace, self.dest)!r}, "
                         f"{values!r}): one dataset file lists every source of the job; give one")
        setattr(namespace, self.dest, values)


def _add_option(group: argparse._ArgumentGroup, dest: str) -> None:
    type_, default, help_ = OPTIONS[dest]
    flag = "--" + dest.replace("_", "-")
    text = help_ if default is None else f"{help_} (default: {default})"
    if type_ is bool:
        # --no-X too, so a flag can turn off what a settings file turns on ("flags win")
        action = "store_true" if dest.startswith("no_") else argparse.BooleanOptionalAction
        text = help_ if action == "store_true" else f"{help_} (default: {str(default).lower()})"
        group.add_argument(flag, action=action, default=argparse.SUPPRESS, help=text)
    elif dest == "shards":
        # `--shards A --shards B` serves both (the second replaced the first, whose shards were
        # never read, and the job ended as done)
        group.add_argument(flag, nargs="+", action="extend", default=argparse.SUPPRESS, help=text)
    elif dest == "dataset":
        group.add_argument(flag, action=_GivenOnce, default=argparse.SUPPRESS, help=text)
    else:
        group.add_argument(flag, type=str.upper if dest == "log_level" else type_,
                           choices=CHOICES.get(dest), default=argparse.SUPPRESS, help=text)


def resolve(args: argparse.Namespace) -> dict:
    """Settings from defaults, then the TOML file, then flags."""
    from mmdispatch.settings import ON_COMMAND_LINE, for_command

    values = {dest: default for dest, (_, default, _) in OPTIONS.items()}
    path = getattr(args, "config", None)
    from_file = {}
    if path:
        from_file = {k: v for k, v in for_command(path, "serve").items() if k in OPTIONS}
    given = {k: v for k, v in vars(args).items() if k in OPTIONS}
    # A --config file's values reach the namespace as defaults; the flags typed are recorded.
    typed = getattr(args, ON_COMMAND_LINE, None)
    flags = {k: v for k, v in given.items() if typed is None or k in typed}
    from_file = {k: v for k, v in from_file.items() if k not in flags}
    _one_of_each_pair(from_file, flags, path)
    values.update(from_file)
    values.update(flags)
    values["_given"] = set(from_file) | set(flags)  # set by the user, not defaults
    if values["shards"] is None and values["dataset"] is None:
        raise ValueError("--shards or --dataset is required (a flag, or shards / dataset in the "
                         "config file's [serve] table)")
    if values["shards"] is not None and values["dataset"] is not None:
        raise ValueError("give --shards or --dataset, not both (a dataset file lists each "
                         "source's shards)")
    for required in ("world_size", "global_batch"):
        if values[required] is None:
            raise ValueError(f"--{required.replace('_', '-')} is required (a flag, or "
                             f"{required} in the config file's [serve] table)")
    if isinstance(values["shards"], str):
        values["shards"] = [values["shards"]]
    return values


#: Settings of which one is given, not both. A flag of a pair on the command line replaces the
#: other one coming from the settings file ("flags win"): a shared file's num_microbatches
#: gives way to a typed --microbatch-token-budget.
EXCLUSIVE_PAIRS = (("num_microbatches", "microbatch_token_budget"), ("shards", "dataset"))


def _one_of_each_pair(from_file: dict, flags: dict, path: str | None) -> None:
    """Drop from `from_file` the half of a pair that a flag replaces; ValueError naming where
    each half came from when both come from the command line or both from the file."""
    for pair in EXCLUSIVE_PAIRS:
        typed = [d for d in pair if flags.get(d) is not None]
        filed = [d for d in pair if from_file.get(d) is not None]
        if len(typed) == 2:
            a, b = pair
            raise ValueError(f"--{a.replace('_', '-')} {_shown(flags[a])} and --{b.replace('_', '-')} "
                             f"{_shown(flags[b])} are both on the command line: give one, not both")
        if len(filed) == 2 and not typed:
            a, b = pair
            raise ValueError(f"config file {path}: [serve] sets both {a} = {from_file[a]!r} and "
                             f"{b} = {from_file[b]!r}: keep one, not both (or give one as a flag, "
                             "which replaces the file's)")
        for dest in typed:
            for other in pair:
                if other != dest:
                    from_file.pop(other, None)


def _shown(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


#: dest -> (least value, what the option counts): integers checked by their flags, since the
#: config classes check them too but by field name (right from Python, not on a command line);
#: an unset option (None) keeps its meaning
AT_LEAST: dict[str, tuple[int, str]] = {
    "shuffle_buffer": (0, "samples per shuffle block; 0 = shard order"),
    "shuffle_shards": (1, "shards a shuffle block draws from"),
    "world_size": (1, "the number of trainer ranks"),
    "global_batch": (1, "samples per step"),
    "token_budget": (1, "LLM tokens per step"),
    "num_microbatches": (1, "micro-batches per step per rank"),
    "microbatch_token_budget": (1, "LLM tokens per rank per micro-batch"),
    "llm_capacity": (1, "LLM tokens per rank per micro-batch"),
    "max_buffered_bytes": (1, "payload bytes held before reader credits stop"),
    "max_retained_steps": (1, "steps sent but not yet acknowledged"),
    "inflight_shards": (1, "shards read at once"),
    "credit_batch": (1, "samples per reader credit grant"),
    "max_shard_losses": (1, "readers lost on one sample before it is skipped"),
    "journal_plan_file_mb": (1, "MB per journal plan file"),
    "max_epochs": (0, "0 = unbounded"),
    "max_steps": (1, "unset = no step limit"),
    "io_threads": (1, "ZeroMQ I/O threads"),
    "malloc_keep_mb": (0, "0 = off"),
    "probe_samples": (0, "0 = no probe"),
}

#: dest -> (most value, why) of the integer options with a bound below 64 bits (the parser
#: refuses any past 64 bits): past these they fail in C code (ZeroMQ aborts the process,
#: glibc's mallopt takes a C int of bytes) or the planner's warm-up runs out of memory (its
#: arrays grow with ranks and micro-batches: about 3 KB a rank, so 10**8 ranks asked
#: for hundreds of GB).
AT_MOST: dict[str, tuple[int, str]] = {
    "world_size": (65536, "the planner is built for thousands of ranks; its memory and time "
                          "per step grow with them"),
    "num_microbatches": (65536, "the planner's memory and time per step grow with them"),
    "io_threads": (64, "ZeroMQ's guide: one I/O thread per GB/s of traffic"),
    "malloc_keep_mb": (MAX_MALLOC_KEEP_MB, "glibc takes the threshold as a C int of bytes"),
}
#: Most (rank, micro-batch) slots a step may plan, world size x micro-batches: the planner
#: holds arrays over them, about 20 bytes a slot (1.4 GB at 65536 ranks x 1024).
MAX_PLAN_SLOTS = 1 << 26
#: Past this factor a micro-batch's capacity is a whole step's tokens many times over (0 says
#: no limit), and capacities past 64 bits fail in the journal.
MAX_LLM_CAPACITY_FACTOR = 1_000_000


def _too_large(v: dict) -> str | None:
    """The message for the first integer option past its AT_MOST bound."""
    for dest, (most, why) in AT_MOST.items():
        if v[dest] is not None and v[dest] > most:
            return (f"--{dest.replace('_', '-')} must be from {AT_LEAST[dest][0]} to {most} "
                    f"({why}), got {v[dest]}")
    return None


def _check_flags(v: dict) -> None:
    """Mistakes worth naming by their flags (the config classes name their own fields)."""
    exchange_bytes(v["exchange_bytes_per_token"])
    for dest, (least, meaning) in AT_LEAST.items():
        if v[dest] is not None and v[dest] < least:
            raise ValueError(f"--{dest.replace('_', '-')} must be >= {least} ({meaning}), got {v[dest]}")
    if (problem := _too_large(v)) is not None:
        raise ValueError(problem)
    if v["ranks_per_node"] < 1:
        raise ValueError(f"--ranks-per-node must be >= 1 (trainer ranks on each node), got "
                         f"{v['ranks_per_node']}")
    if v["world_size"] % v["ranks_per_node"]:
        raise ValueError(f"--ranks-per-node {v['ranks_per_node']} must divide --world-size "
                         f"{v['world_size']} (trainer ranks on each node, the same on every node)")
    factor = v["llm_capacity_factor"]
    if factor is not None and factor != 0 and not 1 <= factor <= MAX_LLM_CAPACITY_FACTOR:
        raise ValueError(f"--llm-capacity-factor must be 0 (no limit) or a number from 1 to "
                         f"{MAX_LLM_CAPACITY_FACTOR}, got {factor}")
    m = v["num_microbatches"]
    if m is not None and m > v["global_batch"]:
        # Every rank would run empty micro-batches every step, and planning time grows with M
        # (100000 takes seconds a step: peers time out while the loop plans).
        raise ValueError(f"--num-microbatches {m} is more than --global-batch {v['global_batch']}: "
                         f"every rank would get empty micro-batches every step; lower it")
    if m is not None and m * v["world_size"] > MAX_PLAN_SLOTS:
        raise ValueError(f"--world-size {v['world_size']} x --num-microbatches {m} is "
                         f"{m * v['world_size']} (rank, micro-batch) slots a step plans, more than "
                         f"{MAX_PLAN_SLOTS} (the planner's memory grows with them); lower "
                         f"--num-microbatches")
    if m is None and v["microbatch_token_budget"] is None:
        m = 1  # the default M (build_config sets it): its empty ranks are as empty
    if m is not None and m * v["world_size"] > v["global_batch"]:
        w, gb = v["world_size"], v["global_batch"]
        fix = f"--global-batch {m * w}" + (f" or --num-microbatches {gb // w}" if gb >= w else "")
        if v["token_budget"] is not None:  # it cuts steps shorter still
            fix += f", with a --token-budget that holds {m * w} samples"
        event("empty_microbatches", logging.WARNING, num_microbatches=m, world_size=w,
              global_batch=gb, why=f"{gb} samples a step for {w} ranks x {m} micro-batches: "
                                   "ranks run empty micro-batches every step", fix=fix)
    if bool(v["curve_secret"]) != bool(v["curve_allowed_dir"]):
        raise ValueError("--curve-secret and --curve-allowed-dir go together: the dispatcher's "
                         "NAME.key_secret and the directory of the peers' allowed NAME.key files")
    for flag, path in (("--curve-secret", v["curve_secret"]), ("--curve-allowed-dir", v["curve_allowed_dir"])):
        if path and not os.path.exists(path):
            raise ValueError(f"{flag} {path!r} does not exist (create key pairs with: mmdispatch keygen "
                             f"NAME --dir DIR; the allowed directory holds the peers' NAME.key files)")
    allowed = v["curve_allowed_dir"]
    if allowed and os.path.exists(allowed) and not os.path.isdir(allowed):
        raise ValueError(f"--curve-allowed-dir {allowed!r} is a file, not a directory: give the "
                         f"directory holding the peers' allowed NAME.key files (mkdir DIR and copy "
                         f"them there)")
    secret = v["curve_secret"]
    if secret and os.path.isdir(secret):
        raise ValueError(f"--curve-secret {secret!r} is a directory, not a file: give the "
                         f"dispatcher's NAME.key_secret file")
    if secret:
        load_secret(secret)  # unreadable, not a key file, the public key: one line, now
        warn_if_readable(secret)
    if allowed and os.path.isdir(allowed):
        check_allowed_keys("--curve-allowed-dir", allowed)
    if v["step_log"] and os.path.isdir(v["step_log"]):
        raise ValueError(f"--step-log {v['step_log']!r} is a directory: give a file to append "
                         f"one JSON line per step to (e.g. {os.path.join(v['step_log'], 'steps.jsonl')})")
    journal = v["journal_dir"]
    if journal and os.path.islink(journal):
        try:
            os.stat(journal)
        except OSError as e:  # a link to nothing, or a loop of links
            raise ValueError(f"--journal-dir {journal!r} is a symbolic link that leads to no "
                             f"directory ({e.strerror}): point it at one, or give the directory "
                             "itself") from None
    if journal and os.path.exists(journal) and not os.path.isdir(journal):
        raise ValueError(f"--journal-dir {journal!r} is not a directory: give the directory the "
                         f"journal lives in (created if missing)")
    if journal and not os.path.isdir(journal):
        # Tried here and taken away again: the journal makes it once serve starts, so a start
        # that fails leaves no empty directory behind.
        made = _missing_dirs(journal)
        try:
            os.makedirs(journal)
        except OSError as e:
            raise ValueError(f"--journal-dir {journal!r} cannot be created ({e.strerror}): give a "
                             "directory the dispatcher can write") from None
        for path in made:
            os.rmdir(path)
    for flag in ("--reader-bind", "--trainer-bind"):
        bind = check_endpoint(flag, v[flag[2:].replace("-", "_")])
        check_ipc_bind(flag, bind)
        check_tcp_bind(flag, bind, "give tcp://HOST:PORT, e.g. tcp://0.0.0.0:5555 for every "
                                   "interface (port 0 lets the OS pick)")
    if not 0 <= v["metrics_port"] <= 65535:
        raise ValueError(f"--metrics-port must be 0 (off) to 65535, got {v['metrics_port']}")
    _check_own_ports(v)
    if not 0 < v["probe_timeout_s"] <= threading.TIMEOUT_MAX:  # the probe thread's join
        raise ValueError(f"--probe-timeout-s must be > 0 and at most {int(threading.TIMEOUT_MAX)} "
                         f"seconds, got {v['probe_timeout_s']}")
    if not 0 < v["heartbeat"] < v["timeout"]:
        raise ValueError(f"--heartbeat {v['heartbeat']} must be > 0 and below --timeout {v['timeout']} "
                         f"(a peer is dropped after missing several heartbeats; e.g. --heartbeat 1 "
                         f"--timeout 5)")


def exchange_bytes(text: str | None) -> dict[str, int]:
    """`--exchange-bytes-per-token` as phase -> bytes ({} unset); ValueError in one line naming
    the value and the form."""
    if not text:
        return {}
    form = "give N, or vision=N,audio=N (bytes of one encoder output token, N >= 1)"
    parts = [p.strip() for p in text.split(",")]
    if len(parts) == 1 and "=" not in parts[0]:
        parts = [f"{phase}={parts[0]}" for phase in ENCODER_PHASES]
    out: dict[str, int] = {}
    for part in parts:
        phase, eq, number = part.partition("=")
        phase = phase.strip()
        if not eq or phase not in ENCODER_PHASES or phase in out:
            what = (f"phase {phase!r} is given twice" if phase in out else
                    f"{part!r} names no encoder phase ({', '.join(ENCODER_PHASES)})")
            raise ValueError(f"--exchange-bytes-per-token {text!r}: {what}; {form}")
        if not number.strip().isdigit() or int(number) < 1:
            raise ValueError(f"--exchange-bytes-per-token {text!r}: {number.strip()!r} is no "
                             f"byte count; {form}")
        out[phase] = int(number)
    return out


def _check_own_ports(v: dict) -> None:
    """Two of this command's own sockets on one TCP port and address: said as such, naming
    both flags (binding, the second would blame "another process")."""
    taken: dict[int, list[tuple[str, str]]] = {}
    for flag, host, port in (("--reader-bind", *_host_port(v["reader_bind"])),
                             ("--trainer-bind", *_host_port(v["trainer_bind"])),
                             ("--metrics-port", v["metrics_host"], v["metrics_port"])):
        for other, other_host in taken.get(port, ()) if port else ():
            if host == other_host or {host, other_host} & _ANY_ADDRESS:
                raise ValueError(f"{other} and {flag} both name port {port}: give each its own "
                                 "port (port 0 lets the OS pick)")
        taken.setdefault(port, []).append((flag, host))


#: Bind addresses that take every interface, so they clash with any other on the same port.
_ANY_ADDRESS = frozenset({"0.0.0.0", "*", "::", "[::]", ""})


def _host_port(address: str) -> tuple[str, int]:
    """(host, port) of a tcp:// endpoint; port 0 for anything else (ipc://, an interface name)."""
    if not address.startswith("tcp://"):
        return "", 0
    host, _, port = address[len("tcp://"):].rpartition(":")
    return host, int(port) if port.isdigit() else 0


def _missing_dirs(path: str) -> list[str]:
    """`path` and each missing directory above it, deepest first (what makedirs would make)."""
    path, missing = os.path.abspath(path), []
    while not os.path.exists(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    return missing


#: field -> flag of the multi-word option names, which the config classes' messages use
#: (single words such as `mode` and `seed` are also plain English there)
_FLAGS = {dest: "--" + dest.replace("_", "-") for dest in OPTIONS if "_" in dest}


def build_config(v: dict) -> ServerConfig:
    with named_by_flags(_FLAGS):
        _check_flags(v)
    # Outside named_by_flags: a dataset file's message names the file's keys (its
    # `shuffle_buffer`), which are not the flags of the same names.
    dataset = load_dataset(v["dataset"]) if v["dataset"] is not None else None
    with named_by_flags(_FLAGS):
        return _build_config(v, dataset)


def _build_config(v: dict, dataset: tuple[list[Source], int | None] | None) -> ServerConfig:
    if v["num_microbatches"] is None and v["microbatch_token_budget"] is None:
        v["num_microbatches"] = 1
    shuffle = v["shuffle_buffer"]
    if dataset is not None:
        sources, file_shuffle = dataset
        if file_shuffle is not None and "shuffle_buffer" not in v.get("_given", ()):
            shuffle = file_shuffle
    else:
        sources = [Source(name="default", shards=expand_shards(v["shards"]))]
    # Readers (and trainers, with reference payloads) open these paths from their own
    # working directories: a relative one means the dispatcher's, as a dataset file's do.
    for src in sources:
        src.shards = [absolute_url(u) for u in src.shards]
    return ServerConfig(
        sources=sources, shuffle_buffer=shuffle, shuffle_shards=v["shuffle_shards"],
        world_size=v["world_size"],
        ranks_per_node=v["ranks_per_node"], seed=v["seed"], mode=v["mode"],
        batch=BatchConfig(global_batch=v["global_batch"], token_budget=v["token_budget"]),
        planner=PlannerConfig(num_microbatches=v["num_microbatches"],
                              microbatch_token_budget=v["microbatch_token_budget"],
                              llm_capacity=v["llm_capacity"], oversize=v["oversize"],
                              llm_capacity_factor=v["llm_capacity_factor"] or None,
                              bytes_per_token=exchange_bytes(v["exchange_bytes_per_token"]),
                              **({"cost": load_cost_file(v["cost_model"])} if v["cost_model"] else {})),
        flow=FlowConfig(max_buffered_samples=v["max_buffered_samples"],
                        max_buffered_bytes=v["max_buffered_bytes"],
                        max_retained_steps=v["max_retained_steps"],
                        num_inflight_shards=v["inflight_shards"], credit_batch=v["credit_batch"]),
        liveness=LivenessConfig(heartbeat_s=v["heartbeat"], timeout_s=v["timeout"],
                                max_shard_losses=v["max_shard_losses"]),
        reader_bind=v["reader_bind"], trainer_bind=v["trainer_bind"],
        journal_dir=v["journal_dir"], journal_fsync=not v["no_fsync"],
        journal_plan_file_bytes=v["journal_plan_file_mb"] << 20,
        max_epochs=v["max_epochs"] or None, max_steps=v["max_steps"],
        metrics_port=v["metrics_port"], metrics_host=v["metrics_host"], step_log=v["step_log"],
        payloads=v["payloads"], refit=RefitConfig() if v["refit"] else None,
        curve=CurveConfig(server_secret_file=v["curve_secret"],
                          allowed_keys_dir=v["curve_allowed_dir"]) if v["curve_secret"] else None,
    )


def ready_line(ready: dict, log_format: str) -> str:
    """The line `serve` prints on stdout once it is bound and its planner loaded: `READY {json}`, or under
    `--log-format json` one JSON object like its log lines (`"event": "ready"` and the same
    fields), so a collector reading stdout and stderr together parses every line."""
    if log_format != "json":
        return "READY " + json.dumps(ready)
    return json_line("READY", event="ready", **ready)


def parse_ready(line: str) -> dict | None:
    """The endpoints on a `ready_line` (either format); None for any other line."""
    if line.startswith("READY "):
        return json.loads(line[len("READY "):])
    if line.startswith("{"):
        try:
            fields = json.loads(line)
        except ValueError:
            return None
        if isinstance(fields, dict) and fields.get("event") == "ready":
            return {k: v for k, v in fields.items()
                    if k not in ("time", "level", "logger", "message", "event")}
    return None


def read_ready(stdout, timeout: float = 30.0) -> dict:
    """The endpoints a `mmdispatch serve` child printed on its ready line (`ready_line`).

    For launchers (demo, tests, benchmarks) that start the dispatcher with port 0; raises
    RuntimeError if the child exits or stays silent for `timeout` seconds.
    """
    sel = selectors.DefaultSelector()
    sel.register(stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if sel.select(0.2):
                line = stdout.readline()
                ready = parse_ready(line)
                if ready is not None:
                    return ready
                if not line:
                    break
    finally:
        sel.close()
    raise RuntimeError(f"mmdispatch serve reported no endpoints within {timeout} s")


def _probe(sources: list, max_samples: int, timeout_s: float) -> None:
    """Refuse (ValueError, one line) a source in which no probed sample has a member its field
    map uses; each source is probed with its own field map (the default where it has none)."""
    from pipeline.fieldmap import FieldMap
    from pipeline.probe import log_unprobed, probe_within, refusal
    from pipeline.reader import ReaderConfig

    for src in sources:
        fields = FieldMap.from_dict(src.fields) if src.fields else FieldMap()
        result = probe_within(src.shards, ReaderConfig(keep_members=False, fields=fields),
                              timeout_s=timeout_s, max_samples=max_samples)
        log_unprobed(result, src.name)
        problem = refusal(result, src.name)
        if problem is not None:
            raise ValueError(problem)


def _warn_unshuffled(config: ServerConfig) -> None:
    """A source whose share of the shuffle buffer (buffer x weight) rounds to one sample is
    read in order: said at start, with the buffer that would shuffle it."""
    if config.shuffle_buffer <= 1:
        return
    for src, weight, block in zip(config.sources, config.weights, config.block_sizes):
        if block <= 1:
            enough = _buffer_that_shuffles(weight)
            held = None if enough is None else _samples_held_with(config, enough)
            if held is None or held > PRACTICAL_BUFFERED_SAMPLES:
                fix = ("its share of the blend is too small for any practical buffer to shuffle it"
                       + ("" if enough is None else f" (--shuffle-buffer {enough}, with "
                          f"--max-buffered-samples {held}: samples the dispatcher would hold)"))
            elif held > config.flow.max_buffered_samples:  # the buffer alone would be refused
                fix = (f"--shuffle-buffer {enough} or more shuffles it, with --max-buffered-samples "
                       f"{held} or more (the samples the dispatcher holds include the buffer)")
            else:
                fix = f"--shuffle-buffer {enough} or more shuffles it"
            event("source_not_shuffled", logging.WARNING, source=src.name, weight=f"{weight:.3g}",
                  shuffle_buffer=config.shuffle_buffer,
                  fix=f"its share of the buffer is under 2 samples: {fix}")


#: Past this many samples held, a suggested shuffle buffer is no fix: at about 2 KB a buffered
#: sample (more with inline payloads), 10^8 of them are hundreds of GB of dispatcher memory.
PRACTICAL_BUFFERED_SAMPLES = 10**8


def _samples_held_with(config: ServerConfig, shuffle_buffer: int) -> int:
    """The least --max-buffered-samples `config` would start with at `shuffle_buffer`."""
    trial = copy.copy(config)  # not dataclasses.replace: that validates against the old bound
    trial.shuffle_buffer = shuffle_buffer
    return trial.least_buffered_samples


def _buffer_that_shuffles(weight: float) -> int | None:
    """The smallest shuffle buffer whose share at normalized `weight` rounds to 2 samples; None
    where none fits in 64 bits (a weight that underflowed to 0 would divide by zero)."""
    if not weight > 0 or not 1.5 / weight < 2**63:
        return None
    enough = math.ceil(1.5 / weight - 1e-9)
    return enough + (round(enough * weight) < 2)


def _unbindable(e: zmq.ZMQError, config: ServerConfig) -> str:
    """A bind ZeroMQ refused (a host that does not resolve, an address or interface this
    machine lacks): one line naming the flag and its value. pyzmq adds the endpoint as
    `(addr='...')` to the error's text."""
    binds = (("--reader-bind", config.reader_bind), ("--trainer-bind", config.trainer_bind))
    named = [(f, a) for f, a in binds if repr(a) in str(e)]  # both when the two are equal
    flag, addr = (named[0] if len(named) == 1
                  else ("--reader-bind / --trainer-bind", (named or binds)[0][1]))
    return (f"{flag} {addr!r} cannot be bound ({os.strerror(e.errno)}): give an address or "
            f"interface of this machine (tcp://0.0.0.0:PORT for every interface, "
            f"tcp://[::]:PORT for every IPv6 one, tcp://eth0:PORT for an interface by name)")


def _warm_in_background(server: Dispatcher, config, on_ready) -> list[BaseException]:
    """Load (on a fresh install: compile, half a minute) the planner's kernels in a thread while
    the server's loop already answers peers; it plans no step before they are ready, and calls
    `on_ready()` then. Returns the list that receives what the warm-up raised (the server is
    then stopped)."""
    failed: list[BaseException] = []

    def warm() -> None:
        t0 = time.monotonic()
        try:
            warm_up(Topology(world_size=config.world_size, ranks_per_node=config.ranks_per_node),
                    config.planner)
        except BaseException as e:  # noqa: BLE001 - raised again by the main thread
            failed.append(e)
            server.stop_soon()
            return
        event("planner_ready", seconds=round(time.monotonic() - t0, 1))
        server.planner_ready.set()
        on_ready()

    server.planner_ready.clear()
    threading.Thread(target=warm, name="mmdispatch-planner-warm-up", daemon=True).start()
    return failed


def run(args: argparse.Namespace) -> int:
    values = resolve(args)
    setup_logging(getattr(args, "log_format", "text"), values["log_level"])
    config = build_config(values)
    _warn_unshuffled(config)
    # Until the dispatcher serves (and stops on SIGTERM by itself), SIGTERM unwinds the start:
    # the probe ends the shard commands it started, instead of leaving them orphaned.
    unwind_on_sigterm()
    if values["probe_samples"]:
        _probe(config.sources, values["probe_samples"], values["probe_timeout_s"])
    keep_freed_memory(values["malloc_keep_mb"])
    collect_on_a_clock()
    # The dispatcher before the planner's warm-up (20 s on a fresh machine): its binds, keys
    # and journal are mistakes worth a line within seconds.
    try:
        server = Dispatcher(config, context=zmq.Context(io_threads=values["io_threads"]))
    except HaltedJob as e:
        raise ValueError(str(e)) from None  # one line: the planner ended this job before
    except zmq.ZMQError as e:
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"{e}: another process holds that port; choose another port in "
                             f"--reader-bind / --trainer-bind (port 0 lets the OS pick)") from None
        if e.errno not in (errno.ENODEV, errno.EINVAL, errno.EADDRNOTAVAIL):
            raise
        raise ValueError(_unbindable(e, config)) from None
    ready = {"readers": server.reader_endpoint, "trainers": server.trainer_endpoint,
             "metrics_port": server.metrics.port, "next_step": server.next_plan}
    signals: list[str] = []

    def stop(signum, _frame) -> None:
        signals.append(signal.Signals(signum).name)
        server.stop_soon()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # before READY: it may come at once
        signal.signal(sig, stop)
    # READY once the planner is loaded too (what a script starting peers after it, and a memory
    # baseline taken at it, expect); peers that connect before it are answered meanwhile.
    line = ready_line(ready, getattr(args, "log_format", "text"))
    warm_failed = _warm_in_background(server, config, lambda: print(line, flush=True))
    server.run(until_done=values["exit_when_done"])
    if warm_failed:
        raise warm_failed[0]
    if server.fatal is not None:
        say(f"mmdispatch serve: stopped: {server.fatal}")
        return 1  # not 2: the settings were fine, the run could not go on
    if server.resume_wait_over is not None and not signals:
        # Not "done": an orchestrator reading status 0 took the job as finished.
        event("stopped", logging.WARNING, reason="resume_wait_over",
              untrained_steps=server.resume_wait_over, next_step=server.next_plan,
              last_commit=server.replay.committed,
              why=f"no job resumed within {LOST_RANK_GRACE_S:.0f} s of the end: a rank left "
                  "(or was lost) with these steps after the last commit",
              fix=("restart the trainers from their checkpoint with the dispatcher started "
                   "again on its --journal-dir: the steps are planned again from there"
                   if config.journal_dir else "run serve with --journal-dir, so that a restart "
                   "of the dispatcher can resume such steps"))
        return 1
    # A planned stop reads as one in the log, not as a crash's silence.
    event("stopped", reason=signals[0] if signals else "done", next_step=server.next_plan,
          last_commit=server.replay.committed)
    return 0
