"""Collectives of kimik3.distributed.runtime on 2 real gloo processes (torch.multiprocessing, forked)."""

from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from kimik3.distributed.runtime import main_rank_first


def _two_ranks(rank: int, tmp: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=rank, world_size=2)
    try:
        prepared = tmp / "prepared"

        def prepare() -> str:
            if rank == 0:  # rank 0 creates the shared thing slowly; rank 1 must find it done
                time.sleep(0.5)
                prepared.write_text("shards")
            with open(tmp / "calls", "a") as f:
                f.write(f"{rank}\n")
            return prepared.read_text()  # rank 1 before rank 0 finished: FileNotFoundError

        (tmp / f"result{rank}").write_text(main_rank_first(prepare, "prepare the data"))

        def broken() -> str:
            raise ValueError(f"no such source (rank {rank})")

        try:
            main_rank_first(broken, "prepare the data")
        except ValueError as e:
            (tmp / f"error{rank}").write_text(str(e))
    finally:
        dist.destroy_process_group()


def test_main_rank_first_runs_rank_0_before_the_others_and_shares_its_failure(tmp_path):
    mp.start_processes(_two_ranks, args=(tmp_path,), nprocs=2, start_method="fork")  # no re-import: ~1 s
    assert (tmp_path / "calls").read_text().split() == ["0", "1"]
    assert [(tmp_path / f"result{r}").read_text() for r in (0, 1)] == ["shards", "shards"]
    assert (tmp_path / "error0").read_text() == "no such source (rank 0)"
    assert (tmp_path / "error1").read_text() == "rank 0 failed to prepare the data: ValueError: no such source (rank 0)"


def test_main_rank_first_in_one_process_just_runs_the_work():
    assert main_rank_first(lambda: 7, "count") == 7
