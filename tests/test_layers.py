"""The layer contracts (pyproject.toml [tool.importlinter], checked by lint-imports in CI) name
the engine's pure subpackages one by one: a subpackage added later is checked only if it is
named there, so the list must be the tree's."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _contracts() -> list[dict]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["importlinter"]["contracts"]


def test_every_engine_subpackage_but_runtime_is_held_to_the_pure_contract():
    tree = {p.parent.name for p in (ROOT / "engine").glob("*/__init__.py")}
    assert "runtime" in tree  # the torch half: the one subpackage the contract leaves out
    sourced = [c for c in _contracts() if c.get("source_modules")]
    pure = [c for c in sourced if all(m.startswith("engine.") for m in c["source_modules"])]
    assert len(pure) == 1, pure
    named = {m.removeprefix("engine.") for m in pure[0]["source_modules"]}
    assert named == tree - {"runtime"}, (
        f"pyproject.toml's pure-engine contract names {sorted(named)}; engine/ holds "
        f"{sorted(tree - {'runtime'})} besides runtime: name the new subpackage there")
    assert {"torch", "triton", "carve_kernels", "engine.runtime"} <= set(pure[0]["forbidden_modules"])


def test_every_top_level_package_is_a_root_of_the_contracts():
    tree = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "benchmarks"}
    with open(ROOT / "pyproject.toml", "rb") as f:
        roots = set(tomllib.load(f)["tool"]["importlinter"]["root_packages"])
    assert roots == tree, (roots, tree)
