"""Data-node packages import without torch: every module of `pipeline` and `dispatcher_server`."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROBE = textwrap.dedent(
    """
    import importlib, pkgutil, sys
    names = []
    for package in ("pipeline", "dispatcher_server"):
        pkg = importlib.import_module(package)
        names.append(package)
        for info in pkgutil.walk_packages(pkg.__path__, prefix=package + "."):
            importlib.import_module(info.name)
            names.append(info.name)
    leaked = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    print(len(names), ",".join(names))
    if leaked:
        sys.exit("torch leaked: " + ",".join(leaked[:5]))
    """
)


def test_data_node_packages_import_without_torch():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    count, names = proc.stdout.split()
    modules = names.split(",")
    assert int(count) == len(modules)
    # The walk found real modules, not just the package roots.
    assert {"pipeline.reader", "pipeline.counting", "pipeline.shards", "dispatcher_server.planner.types"} <= set(modules)
