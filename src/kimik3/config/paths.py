"""Where the Hydra config tree lives: the one definition kimik3-train and kimik3-prepare share."""

from __future__ import annotations

from pathlib import Path

CONF_DIR = Path(__file__).resolve().parents[3] / "conf"
"""The repository's conf/ (src layout: src/kimik3/config/paths.py -> <repo>/conf; kimik3 is installed
editable from its checkout). Absolute, so Hydra never takes it for a Python module path."""


def model_presets() -> list[str]:
    """Names of the conf/model presets (`model=<name>`), for command lines that take one."""
    return sorted(path.stem for path in (CONF_DIR / "model").glob("*.yaml"))
