"""Run dir names, run.json sessions, refusal of reused dirs, cleanup of unstarted sessions, recipe diffs."""

from __future__ import annotations

import json
import os
import re

import pytest

from kimik3.config.schema import RootConfig
from kimik3.runs.run_dir import (
    ERROR_FILE,
    MANIFEST,
    RESOLVED_CONFIG,
    RunDirError,
    check_new_or_resuming,
    compare_recipes,
    config_hash,
    discard_unstarted,
    end_session,
    mark_failed,
    new_run_id,
    read_manifest,
    start_session,
)

MODEL = {"name": "smoke", "arch": "smoke_test_lm", "params_total": 10, "params_activated": 10}


def test_run_ids_started_in_the_same_second_differ():
    ids = {new_run_id({}) for _ in range(50)}
    assert len(ids) == 50
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_[0-9a-f]{6}", i) for i in ids)


def test_explicit_run_id_wins_and_is_checked():
    assert new_run_id({"KIMIK3_RUN_ID": "exp-1.a", "TORCHELASTIC_RUN_ID": "x"}) == "exp-1.a"
    with pytest.raises(RunDirError, match="KIMIK3_RUN_ID='a/b'"):
        new_run_id({"KIMIK3_RUN_ID": "a/b"})


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
def test_torchrun_ranks_agree_on_the_run_id_by_construction():
    """Every rank of one torchrun is a child of the same agent: same env + same parent -> same name."""
    env = {"TORCHELASTIC_RUN_ID": "none", "LOCAL_RANK": "0"}
    first = new_run_id(env)
    assert new_run_id({**env, "LOCAL_RANK": "1"}) == first
    assert new_run_id({**env, "TORCHELASTIC_RUN_ID": "other"}) != first
    with pytest.raises(RunDirError, match="multi-node torchrun needs KIMIK3_RUN_ID"):
        new_run_id({**env, "GROUP_WORLD_SIZE": "2"})


def test_sessions_append_and_reuse_is_refused(tmp_path):
    cfg = RootConfig()
    run_dir = tmp_path / "run"
    assert check_new_or_resuming(run_dir, resuming_here=False) is False
    start_session(run_dir, run_id="r", cfg=cfg, overrides=["a=1"], model=MODEL, dataset={"name": "d"},
                  session={"resumed_from": None})
    end_session(run_dir, "finished", 5)
    with pytest.raises(RunDirError, match="already holds a run .* train.resume="):
        check_new_or_resuming(run_dir, resuming_here=False)
    assert check_new_or_resuming(run_dir, resuming_here=True) is True
    start_session(run_dir, run_id="r", cfg=cfg, overrides=["a=1", "train.resume=x"], model=MODEL,
                  dataset={"name": "d"}, session={"resumed_from": "x"})
    manifest = read_manifest(run_dir)
    assert manifest["format"] == 1 and manifest["config_hash"] == config_hash(cfg)
    assert [s.get("status") for s in manifest["sessions"]] == ["finished", None]
    assert manifest["sessions"][1]["resumed_from"] == "x" and manifest["overrides"] == ["a=1"]
    assert (run_dir / RESOLVED_CONFIG).is_file()
    with pytest.raises(RunDirError, match="belongs to run 'r', not 'q'"):
        start_session(run_dir, run_id="q", cfg=cfg, overrides=[], model=MODEL, dataset={}, session={})


def test_config_hash_follows_the_recipe():
    a, b = RootConfig(), RootConfig()
    assert config_hash(a) == config_hash(b)
    b.train.lr *= 2
    assert config_hash(a) != config_hash(b)


def test_discard_unstarted_removes_only_hydra_files(tmp_path):
    fresh = tmp_path / "fresh"
    (fresh / ".hydra").mkdir(parents=True)
    (fresh / ".hydra" / "config.yaml").write_text("x: 1")
    (fresh / "train.log").write_text("")
    discard_unstarted(fresh, fresh / ".hydra", fresh / "train.log")
    assert not fresh.exists()

    shared = tmp_path / "shared"  # hydra.run.dir pointed at a directory with the user's own files
    (shared / ".hydra").mkdir(parents=True)
    (shared / "notes.txt").write_text("mine")
    discard_unstarted(shared, shared / ".hydra", None)
    assert sorted(p.name for p in shared.iterdir()) == ["notes.txt"]


def test_mark_failed_appends_one_line(tmp_path):
    mark_failed(tmp_path, "first")
    mark_failed(tmp_path, "second")
    lines = (tmp_path / ERROR_FILE).read_text().splitlines()
    assert [line.split(" ", 1)[1] for line in lines] == ["first", "second"]


def test_compare_recipes_names_the_fields():
    saved = {"train": {"lr": 0.001, "seed": 1}, "model": {"name": "smoke"}}
    compare_recipes(saved, json.loads(json.dumps(saved)), "run")
    with pytest.raises(RunDirError, match=r"differs at train.lr \(saved 0.001, now 0.003\)$"):
        compare_recipes(saved, {"train": {"lr": 0.003, "seed": 1}, "model": {"name": "smoke"}}, "run")


def test_manifest_is_json_with_the_contract_fields(tmp_path):
    start_session(tmp_path, run_id="r", cfg=RootConfig(), overrides=[], model=MODEL, dataset={"name": "d"},
                  session={"resumed_from": None, "world_size": 1, "device": "cpu", "kda_implementation": "chunk",
                           "torch_version": "x", "peak_flops": None})
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert set(manifest) >= {"format", "run_id", "created", "model", "dataset", "config_hash", "overrides", "sessions"}
    assert set(manifest["sessions"][0]) >= {"session_id", "started", "resumed_from", "world_size", "git_commit",
                                            "kimik3_version", "torch_version", "device", "kda_implementation",
                                            "peak_flops"}
