"""Configuration of the dispatcher server: what to read, how to batch, how much to hold, where to bind.

Memory is bounded by `FlowConfig` alone: samples held anywhere in the dispatcher (shard
buffers, the step being filled, steps sent but not yet acknowledged) plus reader credits
outstanding never exceed `max_buffered_samples`, and new credits stop at `max_buffered_bytes`,
as does planning ahead (`Delivery.has_room`: one step is always planned).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

from dispatcher_server.blend import normalized
from dispatcher_server.measure import RefitConfig
from dispatcher_server.planner.config import PlannerConfig
from dispatcher_server.protocol import (DEFAULT_LIMITS, DEFAULT_SOURCE, PAYLOAD_MODES, Limits,
                                        reference_path)

MODES = ("deterministic", "arrival")
#: Most times a source's blend weight may be below the largest one: past it the source would be
#: drawn once in more than 10**12 samples, and its normalized weight loses its digits or becomes
#: 0 (1e-320 beside 1), which neither the blend nor the shuffle buffer's shares can use.
MAX_WEIGHT_RATIO = 1e12

#: Fields `dataset_fingerprint` leaves out at their default (so that checkpoints written before
#: the field existed still match), with that default: what a missing one means.
DATASET_FINGERPRINT_DEFAULTS = {"shuffle_shards": 1}


@dataclass(kw_only=True, slots=True)
class BatchConfig:
    """Global batch rule: `global_batch` samples per step, cut earlier at `token_budget` LLM tokens."""

    global_batch: int
    token_budget: int | None = None

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {self.global_batch}")
        # The budget travels in the dataset fingerprint of every WELCOME, as a 64-bit integer.
        if self.token_budget is not None and not 1 <= self.token_budget < 2**63:
            raise ValueError(f"token_budget must be from 1 to 2**63 - 1, got {self.token_budget}")


@dataclass(kw_only=True, slots=True)
class FlowConfig:
    """Credits and memory bounds."""

    max_buffered_samples: int = 4096
    max_buffered_bytes: int = 256 << 20
    max_retained_steps: int = 4  # steps planned but not yet acknowledged by every rank
    num_inflight_shards: int = 8  # shards read at once (the reorder window of deterministic mode)
    credit_batch: int = 32  # samples per reader credit grant (and per SAMPLES message)


@dataclass(kw_only=True, slots=True)
class LivenessConfig:
    heartbeat_s: float = 1.0
    timeout_s: float = 5.0
    poll_ms: int = 50
    # Readers lost (silent past timeout_s) in a row while reading one shard at the same sample
    # before that sample is skipped: a sample that kills every reader cannot stall a job.
    max_shard_losses: int = 3

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s < self.timeout_s:
            raise ValueError(f"need 0 < heartbeat_s ({self.heartbeat_s}) < timeout_s ({self.timeout_s})")
        if self.max_shard_losses < 1:
            raise ValueError(f"max_shard_losses must be >= 1, got {self.max_shard_losses}")


@dataclass(kw_only=True, slots=True)
class CurveConfig:
    """Require CurveZMQ: the server's secret key file and a directory of allowed public keys."""

    server_secret_file: str
    allowed_keys_dir: str


@dataclass(kw_only=True, slots=True)
class Source:
    """One source of a dataset: its shards, its blend weight and its field map.

    `fields` (kind -> member extensions) tells readers which members are images, audio, video,
    text or conversations; None keeps the readers' default map.
    """

    name: str
    shards: list[str]
    weight: float = 1.0
    fields: dict | None = None

    def __post_init__(self) -> None:
        if not self.shards:
            raise ValueError(f"source {self.name!r} has no shards")
        if not 0 < self.weight < math.inf:  # an infinite weight normalizes the blend to nan
            raise ValueError(f"source {self.name!r}: weight must be a finite number > 0, got {self.weight}")


def weight_problem(sources: list[Source]) -> tuple[int, str] | None:
    """(index, why) of the first source whose blend weight is too small beside the largest
    (`MAX_WEIGHT_RATIO`), `why` to follow the weight in a message; None if all can be blended."""
    weights = [src.weight for src in sources]
    top = sources[weights.index(max(weights))]
    for i, (w, share) in enumerate(zip(weights, normalized(weights))):
        if not share > 0 or w * MAX_WEIGHT_RATIO < top.weight:  # a product: top / w overflows
            return i, (f"is more than {MAX_WEIGHT_RATIO:.0e} times below the largest weight, "
                       f"{top.weight!r} (source {top.name!r}): the blend would never draw it; "
                       "raise it or leave the source out")
    return None


@dataclass(kw_only=True, slots=True)
class ServerConfig:
    """What to serve: `sources` (a blend), or `shards` alone as one source named "default"."""

    shards: list[str] = field(default_factory=list)
    world_size: int
    batch: BatchConfig
    planner: PlannerConfig
    ranks_per_node: int = 1
    seed: int = 0
    mode: str = "deterministic"
    reader_bind: str = "tcp://127.0.0.1:0"
    trainer_bind: str = "tcp://127.0.0.1:0"
    journal_dir: str | None = None
    journal_fsync: bool = True
    journal_plan_file_bytes: int = 64 << 20  # see journal.Journal
    journal_file_bytes: int = 1 << 20  # journal.mmd size that triggers a checkpoint
    journal_keep_commits: int = 8  # a checkpoint keeps steps from the oldest of these commits
    max_epochs: int | None = 1
    max_steps: int | None = None
    flow: FlowConfig = field(default_factory=FlowConfig)
    liveness: LivenessConfig = field(default_factory=LivenessConfig)
    limits: Limits = DEFAULT_LIMITS
    curve: CurveConfig | None = None
    metrics_port: int = 0  # 0: no metrics endpoint
    metrics_host: str = "127.0.0.1"
    step_log: str | None = None  # JSON lines per planned step, with the random baseline's metrics
    # or "reference": trainers read member bytes from the shard files; "direct": they fetch
    # them from the readers (protocol.PAYLOAD_MODES)
    payloads: str = "inline"
    refit: RefitConfig | None = None  # refit the cost model online from trainers' timings
    sources: list[Source] = field(default_factory=list)
    # Samples per seeded shuffle block, shared by the sources in proportion to their weights
    # (see assembler.SourceStream); 0 or 1 keeps each source's order (shard order, then index).
    shuffle_buffer: int = 1000
    # Shards each source's shuffle block draws from side by side (assembler._Fill); 1: one
    # after another. Deterministic mode; each source's window opens at least this many.
    shuffle_shards: int = 1

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.sources and self.shards:
            raise ValueError("give either sources or shards, not both")
        if not self.sources:
            if not self.shards:
                raise ValueError("the shard list is empty")
            self.sources = [Source(name=DEFAULT_SOURCE, shards=list(self.shards))]
        self.shards = [url for src in self.sources for url in src.shards]
        names = [src.name for src in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"source names must be unique, got {names}")
        if (problem := weight_problem(self.sources)) is not None:
            src = self.sources[problem[0]]
            raise ValueError(f"source {src.name!r}: weight {src.weight!r} {problem[1]}")
        if self.shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer must be >= 0, got {self.shuffle_buffer}")
        if self.shuffle_shards < 1:
            raise ValueError(f"shuffle_shards must be >= 1, got {self.shuffle_shards}")
        if self.shuffle_shards > 1 and self.mode != "deterministic":
            raise ValueError(f"shuffle_shards={self.shuffle_shards} applies to deterministic mode: "
                             "arrival mode takes samples as readers send them, from every shard "
                             "being read; drop it or use mode deterministic")
        if self.shuffle_shards > 1 and self.shuffle_buffer <= 1:
            raise ValueError(f"shuffle_shards={self.shuffle_shards} mixes the shards of a shuffle "
                             "block, and shuffle_buffer=0 turns the shuffle off; give a "
                             "shuffle_buffer or drop shuffle_shards")
        if self.payloads not in PAYLOAD_MODES:
            raise ValueError(f"payloads must be one of {PAYLOAD_MODES}, got {self.payloads!r}")
        if self.payloads != "inline":
            for url in self.shards:
                reference_path(url, self.payloads)  # ValueError naming the first unfit shard
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not -2**63 <= self.seed < 2**63:  # in the fingerprint every WELCOME carries
            raise ValueError(f"seed must fit in 64 bits (-2**63 to 2**63 - 1), got {self.seed}")
        if self.max_epochs is not None and self.max_epochs < 1:
            raise ValueError(f"max_epochs must be >= 1 or None, got {self.max_epochs}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {self.max_steps}")
        f = self.flow
        if (f.max_retained_steps < 1 or f.num_inflight_shards < 1 or f.credit_batch < 1
                or f.max_buffered_bytes < 1):  # below 1 byte, only starving shards get credits
            raise ValueError(f"flow counts must be >= 1: {f}")
        if self.shard_cap < 1:
            blocks = sum(b for b in self.block_sizes if b > 1)  # as shard_cap counts them
            raise ValueError(
                f"max_buffered_samples={f.max_buffered_samples} is too small: it must exceed "
                f"(max_retained_steps + 1) * global_batch = "
                f"{(f.max_retained_steps + 1) * self.batch.global_batch}"
                + (f" plus the shuffle buffer ({blocks})" if blocks else "")
                + f" by at least the open shards ({sum(self.windows)}); raise it"
                + (" or lower --shuffle-buffer" if blocks else ""))

    @property
    def weights(self) -> list[float]:
        """Blend weights, normalized to sum to 1."""
        return normalized([src.weight for src in self.sources])

    @property
    def windows(self) -> list[int]:
        """Shards each source reads at once: `num_inflight_shards` shared by weight, at least 1."""
        n = self.flow.num_inflight_shards
        if len(self.sources) == 1:
            return [max(n, self.mixes[0])]
        return [max(1, round(n * w), m) for w, m in zip(self.weights, self.mixes)]

    @property
    def mixes(self) -> list[int]:
        """Shards each source's shuffle blocks draw from side by side (1: none, or no shuffle)."""
        return [self.shuffle_shards if b > 1 else 1 for b in self.block_sizes]

    @property
    def block_sizes(self) -> list[int]:
        """Samples per shuffle block of each source: the buffer shared by weight (1: no shuffle).
        A source drawn at rate w gets w of the buffer, so all sources renew blocks at one pace."""
        if self.shuffle_buffer <= 1:
            return [1] * len(self.sources)
        return [max(1, round(self.shuffle_buffer * w)) for w in self.weights]

    @property
    def shard_cap(self) -> int:
        """Samples one open shard may hold (buffered plus credited) so the heads never starve."""
        spare = self.flow.max_buffered_samples - self.least_buffered_samples + sum(self.windows)
        return spare // sum(self.windows)

    @property
    def least_buffered_samples(self) -> int:
        """The least max_buffered_samples this configuration starts with (a shard_cap of 1):
        the retained steps and the one being assembled, the shuffle blocks, a sample for each
        open shard."""
        blocks = sum(b for b in self.block_sizes if b > 1)
        return ((self.flow.max_retained_steps + 1) * self.batch.global_batch + blocks
                + sum(self.windows))

    def _sources_digest(self) -> dict:
        if len(self.sources) == 1 and self.sources[0].name == DEFAULT_SOURCE:
            return {}
        return {"sources": [[src.name, src.weight, len(src.shards)] for src in self.sources]}

    def dataset_fingerprint(self) -> dict:
        """What a trainer's checkpoint must match to resume here: the sample sequence's inputs
        (shard list as a digest, so it stays small at thousands of shards)."""
        digest = hashlib.blake2b("\0".join(self.shards).encode(), digest_size=8).hexdigest()
        return {"shards": digest, "num_shards": len(self.shards), "seed": self.seed,
                "mode": self.mode, "global_batch": self.batch.global_batch,
                "token_budget": self.batch.token_budget, "shuffle_buffer": self.shuffle_buffer,
                **self._mixed(), **self._sources_digest()}

    def _mixed(self) -> dict:
        # Only when on: checkpoints written before the option match as they did.
        default = DATASET_FINGERPRINT_DEFAULTS["shuffle_shards"]
        return {"shuffle_shards": self.shuffle_shards} if self.shuffle_shards != default else {}

    def plan_settings(self) -> dict:
        """What a step's plan depends on besides its samples and the world size: journaled with
        the steps, so a restart under other settings plans its journaled steps anew."""
        return {"ranks_per_node": self.ranks_per_node, **self.planner.settings()}

    def fingerprint(self) -> dict:
        """What the journal must have been written for: the sample sequence's inputs, and each
        source's field map (it decides what is counted, so which samples are skipped).
        `shuffle_shards` is always recorded: a journal without it predates the check."""
        return {"shards": list(self.shards), "seed": self.seed, "mode": self.mode,
                "global_batch": self.batch.global_batch, "token_budget": self.batch.token_budget,
                "shuffle_buffer": self.shuffle_buffer, "shuffle_shards": self.shuffle_shards,
                **self._sources_digest(),
                "field_maps": {s.name: s.fields for s in self.sources if s.fields is not None}}
