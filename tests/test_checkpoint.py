"""Checkpoints: exact (bitwise) resume on CPU, atomic writes, safe and checked loads."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

import kimik3.checkpoint as ckpt
from kimik3.checkpoint import CheckpointError, check_compatible, load_checkpoint, recipe_of, save_checkpoint
from kimik3.runs.metrics import read_events
from kimik3.train import run

KIMI_TINY = [
    "model=kimi_k3_tiny", "model.hidden_size=32", "model.num_layers=2", "model.layer_types=[kda,mla]",
    "model.num_heads=2", "model.head_dim=16", "model.kda_chunk_size=16", "model.kv_lora_rank=16",
    "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=16", "model.intermediate_size=64",
    "model.num_experts=4", "model.top_k=2", "model.moe_intermediate_size=16", "model.first_k_dense=1",
]
"""kimi_k3 at toy size: one KDA and one MLA layer, the second with a 4-expert MoE."""


def _losses(run_dir) -> list[float]:
    return [e["loss"] for e in read_events(run_dir) if e["event"] == "train"]


@pytest.mark.parametrize("recipe", [
    pytest.param(["model=smoke", "train.optimizer=adamw"], id="smoke-adamw"),
    pytest.param([*KIMI_TINY, "train.optimizer=muon", "train.qk_clip_threshold=0.01"], id="kimi_k3_moe-muon-qkclip"),
])
def test_resume_is_bitwise_identical_to_a_straight_run(compose, tiny_train, tmp_path, recipe):
    """N steps straight == k steps, stop, resume, N - k steps: same losses and same final state, bit for bit."""
    overrides = [*tiny_train, "train.max_steps=6", "train.log_interval=1", "train.eval_interval=3", *recipe]
    straight = tmp_path / "straight"
    run(compose(overrides), straight, run_id="a")

    split = tmp_path / "split"
    run(compose([*overrides, f"train.max_tokens={4 * 2 * 32}"]), split, run_id="b")  # stops after step 4
    assert read_events(split)[-1]["step"] == 4
    run(compose([*overrides, f"train.resume={split}"]), split, run_id="b", resume_here=True)

    assert _losses(split) == _losses(straight) and len(_losses(straight)) == 6
    evals = [{e["step"]: e["val_loss"] for e in read_events(d) if e["event"] == "eval"} for d in (straight, split)]
    assert evals[0] == {3: evals[1][3], 6: evals[1][6]}  # the split run also evaluated at its stop, step 4
    a, b = (load_checkpoint(d / "checkpoints" / "step-000006.pt") for d in (straight, split))
    for key, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][key]), key
    for pid, state in a["optimizer"]["state"].items():
        for key, value in state.items():
            other = b["optimizer"]["state"][pid][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
    assert a["train_state"] == b["train_state"] and a["loaders"]["train"] == b["loaders"]["train"]
    assert a["loaders"]["val"]["position"] == b["loaders"]["val"]["position"]  # (its epoch counts evals)
    if "train.qk_clip_threshold=0.01" in recipe:  # QK-Clip really rescaled weights in both runs
        clips = [[(e["step"], e["layer"], e["head"]) for e in read_events(d) if e["event"] == "qk_clip"]
                 for d in (straight, split)]
        assert clips[0] and clips[0] == clips[1]
    sessions = [e for e in read_events(split) if e["event"] in ("start", "resume", "end")]
    assert [e["event"] for e in sessions] == ["start", "end", "start", "resume", "end"]


def test_a_resume_from_inside_a_log_window_logs_the_straight_runs_losses(compose, tiny_train, tmp_path):
    """A checkpoint between two log steps (what a crash resumes from when train.checkpoint_interval is
    not a multiple of train.log_interval) carries the open window's sums, so the first "train" event
    after the resume averages the same steps as the uninterrupted run's, and the final train_loss
    (train.objective=train_loss) is the same."""
    overrides = ["model=smoke", *tiny_train, "train.max_steps=6", "train.log_interval=4",
                 "train.checkpoint_interval=2", "train.objective=train_loss", "train.schedule=constant"]
    straight = tmp_path / "straight"
    objective = run(compose(overrides), straight, run_id="a")
    resumed = tmp_path / "resumed"  # new runs from the straight run's steps 2 and 6, as after a crash
    run(compose([*overrides, f"train.resume={straight / 'checkpoints' / 'step-000002.pt'}"]), resumed, run_id="b")
    longer = [*overrides, "train.max_steps=8", f"train.resume={straight / 'checkpoints' / 'step-000006.pt'}"]
    continued = run(compose(longer), tmp_path / "continued", run_id="c")
    whole = run(compose([*overrides, "train.max_steps=8"]), tmp_path / "whole", run_id="d")
    train_events = [{e["step"]: (e["loss"], e["grad_norm"]) for e in read_events(d) if e["event"] == "train"}
                    for d in (straight, resumed, tmp_path / "continued", tmp_path / "whole")]
    assert train_events[1] == {4: train_events[0][4], 6: train_events[0][6]}
    assert train_events[2] == {8: train_events[3][8]} and continued == whole  # window 5..8, not 7..8


def test_save_is_atomic_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "step-000001.pt"
    save_checkpoint(path, {"model": {"w": torch.ones(3)}})

    def broken_save(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, {"model": {"w": torch.zeros(3)}})
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.ones(3))  # the old file is intact


def test_resuming_in_place_removes_the_temp_file_of_a_killed_checkpoint_write(compose, tiny_train, tmp_path):
    """A SIGKILL mid-save leaves `.step-<n>.pt.tmp-<pid>` (a checkpoint's size) that resume never
    reads and no later save replaces (another pid): resuming the run removes it, but not the temp file
    of a writer that is still alive."""
    import subprocess
    import sys

    overrides = ["model=smoke", *tiny_train, "train.checkpoint_interval=2"]
    run_dir = tmp_path / "run"
    run(compose([*overrides, "train.max_steps=2"]), run_dir, run_id="a")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = run_dir / "checkpoints" / f".step-000004.pt.tmp-{int(gone.stdout)}"
    live = run_dir / "checkpoints" / f".step-000004.pt.tmp-{os.getppid()}"  # a live process but not this one
    for temp in (killed, live):
        temp.write_bytes(b"half a checkpoint")
    run(compose([*overrides, f"train.resume={run_dir}"]), run_dir, run_id="a", resume_here=True)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        live.name, "step-000002.pt", "step-000004.pt", "step-000006.pt", "step-000008.pt"]


def test_load_refuses_unreadable_foreign_and_pickled_code(tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read checkpoint .*garbage.pt"):
        load_checkpoint(garbage)
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {}}, foreign)
    with pytest.raises(CheckpointError, match="not a kimik3 checkpoint of format 1"):
        load_checkpoint(foreign)
    code = tmp_path / "code.pt"
    torch.save({"format": 1, "payload": random.Random(0)}, code)  # an arbitrary object: weights_only refuses it
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        load_checkpoint(code)


@pytest.mark.parametrize("name,content", [("config.json", b'{"model_type": "kimi_linear"}\n'),
                                          ("metrics.jsonl", b'{"event": "start", "step": 0}\n')])
def test_a_file_that_is_not_a_checkpoint_gets_no_advice_to_drop_weights_only(tmp_path, name, content):
    """torch's own first line says weights_only=False "will likely succeed": wrong for these files,
    and a kimik3 checkpoint never needs it."""
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert str(err.value) == (f"cannot read checkpoint {path}: not a kimik3 checkpoint "
                              "(torch.load with weights_only=True cannot unpickle it)")


def test_rng_round_trip_restores_every_generator():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = ckpt.capture_rng()
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    ckpt.restore_rng(state)
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


def test_check_compatible_names_the_differing_field(tmp_path):
    train = {"batch_size": 2, "seq_len": 32, "grad_accum_steps": 1, "optimizer": "adamw", "lr": 1e-3}
    saved = recipe_of({"hidden_size": 64, "kda_implementation": "chunk"}, 257, {"name": "d"}, train, 1)
    same_but_impl = recipe_of({"hidden_size": 64, "kda_implementation": "triton"}, 257, {"name": "d"},
                              {**train, "lr": 3e-3}, 1)
    check_compatible(saved, same_but_impl, tmp_path)  # implementation and lr may change on resume
    chunk_16 = recipe_of({"hidden_size": 64, "kda_implementation": "chunk", "kda_chunk_size": 16}, 257, {"name": "d"},
                         train, 1)
    triton_64 = recipe_of({"hidden_size": 64, "kda_implementation": "triton", "kda_chunk_size": 64}, 257,
                          {"name": "d"}, train, 1)
    check_compatible(chunk_16, triton_64, tmp_path)  # a CPU chunk-16 run continues on the GPU kernels (chunk 64)
    with pytest.raises(CheckpointError, match=r"model.hidden_size is 64 in the checkpoint but 128 now"):
        check_compatible(saved, recipe_of({"hidden_size": 128}, 257, {"name": "d"}, train, 1), tmp_path)
    with pytest.raises(CheckpointError, match="dataset identity differs"):
        check_compatible(saved, recipe_of({"hidden_size": 64}, 257, {"name": "other"}, train, 1), tmp_path)
    with pytest.raises(CheckpointError, match="train.seq_len is 32"):
        check_compatible(saved, recipe_of({"hidden_size": 64}, 257, {"name": "d"}, {**train, "seq_len": 64}, 1),
                         tmp_path)
    resplit = {**train, "batch_size": 1, "grad_accum_steps": 2}  # the same global batch of 2 sequences
    check_compatible(saved, recipe_of({"hidden_size": 64, "kda_implementation": "chunk"}, 257, {"name": "d"}, resplit, 1),
                     tmp_path)
    with pytest.raises(CheckpointError) as refused:
        check_compatible(saved, recipe_of({"hidden_size": 64, "kda_implementation": "chunk"}, 257, {"name": "d"},
                                          {**resplit, "grad_accum_steps": 4}, 2), tmp_path)
    assert str(refused.value) == (
        f"cannot resume from {tmp_path}: train.global_batch is 2 in the checkpoint but 8 now (world_size x "
        "train.batch_size x train.grad_accum_steps sequences: 1 x 2 x 1 in the checkpoint, 2 x 1 x 4 now); "
        "any split of the same global batch can resume")


def test_resume_refuses_another_model(compose, tiny_train, tmp_path):
    overrides = ["model=smoke", *tiny_train, "train.max_steps=2"]
    run(compose(overrides), tmp_path / "a", run_id="a")
    with pytest.raises(CheckpointError, match="model.hidden_size is 256 in the checkpoint but 64 now"):
        run(compose([*overrides, "model.hidden_size=64", f"train.resume={tmp_path / 'a'}"]), tmp_path / "b",
            run_id="b")
    assert not (tmp_path / "b").exists()  # refused before the run dir was opened
