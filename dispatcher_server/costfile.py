"""Cost files: a calibrated `CostModel` as JSON, written by `mmdispatch calibrate`, read by `serve`.

The planner has no I/O, so reading and writing live here. A file holds the per-phase
coefficients in seconds and, beside them, how they were measured (device, model, fit quality);
only the coefficients are read back. Every way a file can be wrong is one `CostFileError` whose
message names the file.
"""

from __future__ import annotations

import json
import math

from dispatcher_server.files import replace_file
from dispatcher_server.planner.cost import CostModel
from dispatcher_server.planner.types import PHASES

FORMAT = "mmdispatch-cost-model"
VERSION = 1


class CostFileError(ValueError):
    """A cost file cannot be read or does not hold a cost model."""


def cost_file_dict(cost: CostModel, calibration: dict | None = None) -> dict:
    """The JSON object a cost file holds."""
    return {"format": FORMAT, "version": VERSION, "units": "seconds",
            "phases": cost.to_dict(), "calibration": calibration or {}}


def save_cost_file(path: str, cost: CostModel, calibration: dict | None = None) -> None:
    """Write `cost` (and what measured it) to `path`, atomically: a reader sees the old file or
    the new one, never half of it."""
    replace_file(path, (json.dumps(cost_file_dict(cost, calibration), indent=2) + "\n").encode(),
                 durable=False)


def parse_cost_file(data: dict, where: str) -> CostModel:
    """The cost model in a cost file's JSON object; `where` names it in errors."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CostFileError(f"{where} is not an mmdispatch cost file (no \"format\": \"{FORMAT}\"); "
                            "write one with 'mmdispatch calibrate --out FILE'")
    if data.get("version") != VERSION:
        raise CostFileError(f"{where} has cost file version {data.get('version')!r}, this "
                            f"mmdispatch reads version {VERSION}; calibrate again")
    phases = data.get("phases")
    if not isinstance(phases, dict) or not phases:
        raise CostFileError(f"{where} has no \"phases\" object; calibrate again")
    missing = [p for p in PHASES if p not in phases]
    if missing:
        raise CostFileError(f"{where} has no cost for phase(s) {missing}; calibrate every phase")
    for p, v in phases.items():
        nums = [v.get(k) for k in ("a", "b", "c") if k in v] if isinstance(v, dict) else [None]
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                   for x in nums):
            raise CostFileError(f"{where}: phase {p!r} needs finite numbers a, b (and c), got {v!r}")
    try:
        return CostModel.from_dict(phases)
    except (TypeError, ValueError) as e:
        raise CostFileError(f"{where} holds a bad cost model: {e}") from None


def load_cost_file(path: str) -> CostModel:
    """The cost model in the cost file at `path`."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise CostFileError(f"cannot read cost file {path!r}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CostFileError(f"cost file {path!r} is not valid JSON: {e}") from None
    return parse_cost_file(data, f"cost file {path!r}")
