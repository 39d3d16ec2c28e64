"""The pass registry (``passes/_registry.py``) is the one list of passes: what
``PassConfig``, ``TRACEABLE_HSDP_PASSES`` and docs/passes.md show derives from it.
Tier 1: no processes, no compile."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from traceable_hsdp.passes import PassConfig
from traceable_hsdp.passes._registry import ALIASES, PASSES, docs_table, switched

_REPO = Path(__file__).resolve().parent.parent


def test_docs_list_the_registry() -> None:
    page = (_REPO / "docs" / "passes.md").read_text()
    assert docs_table() in page, "docs/passes.md's table differs from docs_table()"


def test_pass_config_and_env_follow_the_registry() -> None:
    names = [f.name for f in fields(PassConfig)]
    assert names[: len(switched())] == list(switched())
    assert names[len(switched()):] == ["pool_exchange_outputs", "bucket_cap_mb"]
    for name in switched():
        only = PassConfig.from_env({"TRACEABLE_HSDP_PASSES": name})
        assert [n for n in switched() if getattr(only, n)] == [name]
    for alias, members in ALIASES.items():
        cfg = PassConfig.from_env({"TRACEABLE_HSDP_PASSES": alias})
        assert [n for n in switched() if getattr(cfg, n)] == list(members)
    assert len({e.name for e in PASSES}) == len(PASSES)
