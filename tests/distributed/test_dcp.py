"""Checkpoint bookkeeping around DCP: which checkpoint resume picks, the global-batch recipe check,
and loader cursors carried across world sizes (the collective save/load runs in test_parallel_training)."""

from __future__ import annotations

import pytest
import torch

from kimik3.checkpoint import CheckpointError, check_compatible, latest_checkpoint, recipe_of, resolve_resume
from kimik3.data import ShardedTokenDataset, TokenDataLoader
from kimik3.distributed.dcp import rebase_loader_state, sharded_checkpoint_path


def _recipe(world: int, batch: int, accum: int, seq_len: int = 64) -> dict:
    train = {"batch_size": batch, "seq_len": seq_len, "grad_accum_steps": accum, "optimizer": "muon"}
    return recipe_of({"hidden_size": 8}, 256, {"name": "d"}, train, world_size=world)


def test_resume_accepts_any_split_of_the_same_global_batch(tmp_path):
    check_compatible(_recipe(2, 4, 1), _recipe(1, 8, 1), tmp_path)
    check_compatible(_recipe(2, 4, 1), _recipe(1, 4, 2), tmp_path)
    check_compatible(_recipe(1, 8, 1), _recipe(4, 1, 2), tmp_path)


def test_resume_refuses_another_global_batch_or_seq_len(tmp_path):
    with pytest.raises(CheckpointError, match="train.global_batch is 8 in the checkpoint but 4 now"):
        check_compatible(_recipe(2, 4, 1), _recipe(1, 4, 1), tmp_path)
    with pytest.raises(CheckpointError, match="train.seq_len is 64 in the checkpoint but 32 now"):
        check_compatible(_recipe(2, 4, 1), _recipe(2, 4, 1, seq_len=32), tmp_path)


def test_latest_checkpoint_sees_dcp_dirs_but_not_unfinished_ones(tmp_path):
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    torch.save({}, ckpts / "step-000010.pt")
    dcp_dir = sharded_checkpoint_path(ckpts / "step-000020.pt")
    assert dcp_dir.name == "step-000020"
    dcp_dir.mkdir()
    assert latest_checkpoint(tmp_path) == ckpts / "step-000010.pt"  # no .metadata: not a checkpoint (yet)
    (dcp_dir / ".metadata").write_bytes(b"")
    (ckpts / ".step-000030.tmp").mkdir()  # a save in progress
    assert latest_checkpoint(tmp_path) == dcp_dir
    assert resolve_resume(str(tmp_path)) == dcp_dir and resolve_resume(str(dcp_dir)) == dcp_dir


def test_loader_cursor_carries_over_to_another_world_size(embedded_data):
    ds = ShardedTokenDataset(embedded_data, "train")
    ranks = [TokenDataLoader(ds, 1, 16, rank=r, world_size=2) for r in range(2)]
    for loader in ranks:
        loader.next_batch()
    one = TokenDataLoader(ds, 2, 16)
    one.load_state_dict(rebase_loader_state(ranks[0].state_dict(), batch_size=2, world_size=1))
    inputs, targets = one.next_batch()
    halves = [loader.next_batch() for loader in ranks]
    assert torch.equal(inputs, torch.cat([h[0] for h in halves]))
    assert torch.equal(targets, torch.cat([h[1] for h in halves]))


def test_a_cursor_left_inside_a_step_by_an_epoch_rewind_names_the_split_that_can_resume(embedded_data):
    """data_end=next_epoch rewinds the split between two micro-batches of a step when the epoch ends
    there, so a checkpoint's cursor can sit one micro-batch into the epoch. Here 2 ranks x 1 sequence
    x 2 micro-batches left it at 32 tokens (one micro-batch of 2 x 16): a split of the same global
    batch whose micro-batch is 32 tokens continues from it; 1 rank x 4 sequences (64 tokens) cannot,
    and the refusal says why and which split can, not just "not a cursor of this loader"."""
    ds = ShardedTokenDataset(embedded_data, "train")
    saved = {**TokenDataLoader(ds, 1, 16, rank=0, world_size=2).state_dict(), "position": 32, "epoch": 1}
    same_micro = TokenDataLoader(ds, 2, 16)
    same_micro.load_state_dict(rebase_loader_state(saved, batch_size=2, world_size=1))
    assert same_micro.position == 32
    with pytest.raises(CheckpointError, match=r"train cursor at token 32 .* 64 tokens .* 2 rank\(s\) x "
                                              r"train\.batch_size=1"):
        rebase_loader_state(saved, batch_size=4, world_size=1)
