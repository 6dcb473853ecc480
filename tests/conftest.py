"""Shared fixtures: one temp data cache for the whole session, the embedded corpus prepared once,
and tiny recipes composed through the real conf/ (so the tests exercise the schemas and YAML)."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Iterator

import pytest
from hydra import compose as hydra_compose, initialize_config_dir
from omegaconf import OmegaConf

from kimik3.config.schema import DataConfig, RootConfig
from kimik3.config.store import register_configs
from kimik3.data import prepare_data
from kimik3.runs.run_dir import register_resolvers
from kimik3.train import CONF_DIR, CONFIG_NAME
import interpreter_memcheck  # tests/ is on sys.path (this conftest's dir)
from recipes import SMOKE, TINY_TRAIN


MISSING_EXTRA_MARK = "pip install"
"""Every skip for a missing optional package says how to install it (e.g. "needs pip install 'kimik3[hf]'")."""


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under KIMIK3_REQUIRE_EXTRAS=1 (.ci/run sets it: CI installs the dev extra, so every package is there)
    a test skipped for a missing package fails the run, so a dependency missing from `[dev]` cannot hide
    behind a green suite."""
    if os.environ.get("KIMIK3_REQUIRE_EXTRAS") != "1" or exitstatus != 0:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    missing = [r for r in reporter.stats.get("skipped", []) if MISSING_EXTRA_MARK in str(r.longrepr)]
    if missing:
        for report in missing:
            reporter.write_line(f"missing package: {report.nodeid}: {report.longrepr}", red=True)
        reporter.write_line("the tests above skipped for a missing package; add it to the dev extra", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def interpreter_memcheck_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Triton kernel the CPU interpreter runs in a test is memchecked (interpreter_memcheck.py):
    an out-of-bounds access, or a race between two programs of a launch, fails the test instead of
    reading stray memory or passing because the interpreter runs programs in sequence."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        interpreter_memcheck.install(monkeypatch)


@pytest.fixture(autouse=True)
def unfrozen_collector() -> Iterator[None]:
    """Each test ends with nothing frozen out of the cyclic collector: trainer.prepare_for_training
    freezes the objects alive then (freeze_startup_objects), and in a long-lived test process their
    reference cycles would otherwise outlive the test that made them."""
    yield
    gc.unfreeze()


@pytest.fixture(scope="session", autouse=True)
def kimik3_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every test (and every subprocess it starts) prepares data into one temp cache, never ~/.cache."""
    cache = tmp_path_factory.mktemp("kimik3-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KIMIK3_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="session")
def embedded_data(kimik3_cache: Path) -> Path:
    """The embedded corpus (the default data config), prepared once per test session."""
    return prepare_data(DataConfig(), progress=False)


def compose_root(overrides: list[str]) -> RootConfig:
    """conf/train.yaml + overrides -> RootConfig, as kimik3-train composes it."""
    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
        cfg = hydra_compose(CONFIG_NAME, overrides=overrides)
    return OmegaConf.to_object(cfg)


@pytest.fixture
def compose(embedded_data: Path):
    """`compose(overrides) -> RootConfig` (the embedded corpus is prepared by then)."""
    return compose_root


@pytest.fixture
def tiny_train() -> list[str]:
    return list(TINY_TRAIN)


@pytest.fixture
def smoke_cfg(embedded_data: Path) -> RootConfig:
    return compose_root(SMOKE)
