"""A job the planner ended: recorded beside the journal so a restart does not walk into it again.

Under `oversize="error"` a step the planner cannot fit under the capacities ends the job once,
naming its largest samples. Restarting with the same planner settings would plan the same
samples into the same refusal, so the dispatcher refuses to start instead, with the same
message; once the settings change (a larger capacity, `--oversize isolate`), it resumes.
"""

from __future__ import annotations

import json
import os

from dispatcher_server.batching import StepBatch
from dispatcher_server.files import replace_file
from dispatcher_server.journal import settings_id
from dispatcher_server.planner import PlannerConfig, Topology

HALT_FILE = "halted.json"


class HaltedJob(RuntimeError):
    """The journal's job was ended by the planner and the planner settings did not change."""


class Halt:
    """Reads and writes `halted.json` in the journal directory."""

    def __init__(self, directory: str, planner: PlannerConfig) -> None:
        self.path = os.path.join(directory, HALT_FILE)
        # the digest the journal names a step's plan settings by: one notion of "the same"
        self.settings = settings_id(planner.settings())

    def check(self) -> None:
        """HaltedJob if the job was halted under these planner settings; forget an older halt."""
        try:
            with open(self.path, encoding="utf-8") as f:
                halt = json.load(f)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            raise HaltedJob(f"{self.path} is unreadable ({e}); remove it to resume") from None
        if halt.get("settings") == self.settings:
            raise HaltedJob(f"this job was ended at step {halt.get('step')}: {halt.get('why')} "
                            f"(change the planner settings to resume, or remove {self.path})")
        os.unlink(self.path)

    def record(self, step: int, why: str) -> None:
        replace_file(self.path, json.dumps({"step": step, "why": why,
                                            "settings": self.settings}).encode())


def oversize_report(step: int, batch: StepBatch, config: PlannerConfig, error: Exception,
                    topology: Topology) -> str:
    """One line naming the step, its largest samples by key and the ways out; where no sample
    is over the LLM capacity alone, that the step as a whole does not fit its micro-batches."""
    llm = batch.inputs.llm_len
    order = sorted(range(len(llm)), key=lambda i: -int(llm[i]))[:3]
    largest = ", ".join(f"{batch.keys[i]} ({int(llm[i])} LLM tokens)" for i in order)
    cap = "" if config.llm_capacity is None else f" over --llm-capacity {config.llm_capacity}"
    if config.llm_capacity is not None and len(llm) and int(llm.max()) <= config.llm_capacity:
        W, M = topology.world_size, config.microbatches_for(batch.inputs, topology)
        return (f"step {step} cannot be planned{cap} ({error}): no sample is over it alone (the "
                f"largest: {largest}), but the step's {int(llm.sum())} LLM tokens do not pack into "
                f"{W} rank{'s' * (W != 1)} x {M} micro-batch{'es' * (M != 1)} of {config.llm_capacity} "
                f"({W * M * config.llm_capacity} in all). Raise --num-microbatches or "
                "--llm-capacity, or lower --global-batch (--oversize isolate adds micro-batches "
                "where a step does not fit)")
    s = getattr(error, "sample", None)
    if s is not None:  # named in the service's terms, not the planner API's (oversize='isolate')
        over = ([f"{int(llm[s])} LLM tokens"] if config.llm_capacity is not None
                and int(llm[s]) > config.llm_capacity else [])
        for p, most in config.encoder_capacity.items():
            it = batch.inputs.items(p)
            padded = config.cost.phase(p).padded_len(it.enc_len[it.sample == s])
            if len(padded) and int(padded.max()) > most:
                over.append(f"a {p} item of {int(padded.max())} tokens, over its capacity {most}")
        why = (f"sample {batch.keys[s]} fits no micro-batch ({', '.join(over) or 'over a capacity'})"
               f"; largest samples: {largest}")
    else:
        why = f"{error}; largest samples: {largest}"
    return (f"step {step} cannot be planned{cap}: {why}. Raise the capacities, or use --oversize "
            "isolate to run such samples alone in extra micro-batches")
