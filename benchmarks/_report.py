"""What the benchmark reports print: names people know, cells that say why they are
empty, numbers without ``-0.0``, and the code a table ran at (``code_state``). Shared
by every script here; measuring is ``_harness.py``'s.

[Note: Report names]
Variants keep short keys (``ours_compiled``, ``torch_block_compiled``): they are what
``--variants`` takes and what the JSON files hold. Tables and plots show a name that
says what ran, in the words of torch's and this project's APIs (``fully_shard``,
``torch.compile``, the pass names of ``TRACEABLE_HSDP_PASSES``), with the key after it
in tables so that a row can be rerun. torch's per-block recipe (torchtitan's) compiles
each block, forward and backward (AOTAutograd compiles the block's backward), while
``fully_shard``'s hooks and collectives run eagerly between the blocks; its name says
"per-block torch.compile", not anything about an eager backward.

[Note: Cells that cannot be measured]
A cell is blank only when its number would be wrong. Collective counts come from the
graphs Inductor compiles, so a variant whose collectives run outside them (eager, or
the per-block recipe, where ``fully_shard``, torch's or ours, issues them between the
graphs) says
"not counted: outside Inductor graphs" instead of 0; the per-block recipe with
compiled autograd, whose one block graph runs once per block, says that instead of
a count per graph. A compile time of an eager variant is "none (eager)", not the
noise of first step minus median.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

NOT_COUNTED = "not counted: outside Inductor graphs"
# The blocks' one graph runs once per block, and the count assumes one run per step
# ([Note: Collectives per step] in _harness.py).
NOT_COUNTED_PER_BLOCK = "not counted: one graph runs for every block"
NO_COMPILE = "none (eager)"

# Keys with fixed names; ours_compiled_no_<pass> is built in label().
_LABELS = {
    "ours_eager": "traceable_hsdp fully_shard, eager",
    "ours_compiled": "traceable_hsdp fully_shard, torch.compile(model)",
    "ours_compiled_nopasses": "traceable_hsdp fully_shard, torch.compile(model), passes off",
    "ours_compiled_per_unit": "traceable_hsdp fully_shard, torch.compile(model), "
                              "one bucket per unit",
    "ours_compiled_cap1mb": "traceable_hsdp fully_shard, torch.compile(model), bucket_cap_mb=1",
    "ours_compiled_cap16mb": "traceable_hsdp fully_shard, torch.compile(model), "
                             "bucket_cap_mb=16",
    "ours_compiled_nofix": "traceable_hsdp fully_shard, torch.compile(model), "
                           "TRACEABLE_HSDP_STABLE_MESH_KEY=0",
    "ours_compiled_torch_fwd_key": "traceable_hsdp fully_shard, torch.compile(model), "
                                   "TRACEABLE_HSDP_FORWARD_CACHE_KEY=0",
    "ours_compiled_side_effect_info": "traceable_hsdp fully_shard, torch.compile(model), "
                                      "TRACEABLE_HSDP_QUIET_SIDE_EFFECTS=0",
    "ours_compiled_local_adamw": "traceable_hsdp fully_shard, torch.compile(model), "
                                 "traceable_hsdp.optim.AdamW",
    "ours_compiled_reshard_root": "traceable_hsdp fully_shard, torch.compile(model), "
                                  "reshard_after_forward=True (the root re-gathered)",
    "ours_block_compiled": "traceable_hsdp fully_shard, per-block torch.compile",
    "ours_block_compiled_ca": "traceable_hsdp fully_shard, per-block torch.compile, "
                              "compiled autograd",
    "ours_per_block": "traceable_hsdp fully_shard, compile_block per block",
    "ours_per_block_pool": "traceable_hsdp fully_shard, compile_block per block, "
                           "with the exchange pool",
    "torch_eager": "torch fully_shard, eager",
    "torch_block_compiled": "torch fully_shard, per-block torch.compile",
    "torch_block_compiled_local_adamw": "torch fully_shard, per-block torch.compile, "
                                        "traceable_hsdp.optim.AdamW",
    "unsharded_compiled_1rank": "unsharded model, torch.compile(model), 1 rank",
    "plain_whole": "unsharded model, torch.compile(model)",
}
_NO_PASS = "ours_compiled_no_"


def label(key: str) -> str:
    """The name a table or plot shows for variant ``key``; see [Note: Report names]."""
    if key in _LABELS:
        return _LABELS[key]
    if key.startswith(_NO_PASS):
        return f"traceable_hsdp fully_shard, torch.compile(model), without {key[len(_NO_PASS):]}"
    return key


def row_name(key: str) -> str:
    """A table's first cell: the name, then the ``--variants`` key."""
    name = label(key)
    return name if name == key else f"{name} (`{key}`)"


def group(key: str) -> str:
    """Which implementation a variant runs, for a plot's colours and legend."""
    if key.startswith("ours"):
        return "traceable_hsdp fully_shard"
    if key.startswith("torch"):
        return "torch fully_shard"
    return "unsharded model (no communication)"


GROUP_COLORS = {
    "traceable_hsdp fully_shard": "tab:blue",
    "torch fully_shard": "tab:orange",
    "unsharded model (no communication)": "tab:gray",
}


def num(x: float | None, spec: str, missing: str = "–") -> str:
    """``x`` formatted, ``missing`` for ``None``; never ``-0.0`` (a value that rounds to
    zero prints as zero)."""
    if x is None:
        return missing
    text = format(x, spec)
    if text.lstrip("-").strip("0.") == "" and text.startswith("-"):
        text = text[1:]
    return text


def compile_seconds(first_step_s: float | None, median_step_s: float) -> float | None:
    """A variant's compile time as every step-time report counts it: its first step
    less a median step. ``None`` when no first step was timed."""
    return None if first_step_s is None else first_step_s - median_step_s


def add_out_argument(p: argparse.ArgumentParser, required: bool = True) -> None:
    """``--out DIR``, required (``required=False``: the caller checks it): results go
    where the user says, never into the repository's committed ``benchmarks/results/``
    unless named."""
    p.add_argument("--out", required=required, default=None, metavar="DIR",
                   help="folder for the report (.md, .json, .png); created if needed. "
                        "Required: nothing is written into the repository by default")


def write_report(out: str, stem: str, text: str, data: Any = None) -> str:
    """Writes ``<out>/<stem>.md`` (the table ``text``) and, with ``data``, ``.json``
    (every raw number); creates ``out``. Returns the path without suffix."""
    os.makedirs(out, exist_ok=True)
    base = os.path.join(out, stem)
    with open(base + ".md", "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")
    if data is not None:
        with open(base + ".json", "w") as f:
            json.dump(data, f, indent=1, default=str)  # str: dtypes, devices, paths
    return base


def code_state() -> dict[str, str]:
    """Where the imported traceable_hsdp comes from: its git commit and which runtime
    or passes files differ from it (or the folder, when it is not a git checkout)."""
    import subprocess

    import traceable_hsdp

    root = os.path.dirname(os.path.dirname(os.path.abspath(traceable_hsdp.__file__)))

    def git(*a: str) -> str:
        try:
            r = subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, timeout=20)
        except Exception as e:  # noqa: BLE001
            return f"? ({e})"
        return r.stdout.strip() if r.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD")
    if not head or git("rev-parse", "--show-toplevel") != root:
        return dict(root=root, head="", dirty_runtime="", diff="", diff_sha256="")
    import hashlib

    diff = git("diff", "HEAD", "--", "traceable_hsdp", "passes")
    return dict(
        root=root, head=head,
        dirty_runtime=git("status", "--porcelain", "--", "traceable_hsdp", "passes"),
        diff=diff,
        diff_sha256=hashlib.sha256(diff.encode()).hexdigest()[:16] if diff else "",
    )


def code_line(code: dict[str, Any]) -> str:
    """Which code a table ran at, for its footer."""
    if not code.get("head"):
        return f"Code: {code.get('root', '?')} (not a git checkout)"
    dirty = code.get("dirty_runtime")
    return f"Code: commit {code['head']}" + (", with uncommitted changes" if dirty else "")


def cpu_name() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (else ``platform.processor()`` or the
    machine), for reports and plots."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"
