"""Which process am I? Ranks and the rendezvous address, read from the launcher's environment.

Ranks come from the environment only, never from argv (every rank gets the same command line):
- torchrun (and torch.distributed.run) sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT. These win whenever RANK and WORLD_SIZE are present.
- SLURM through the submitit launcher (conf/hydra/launcher/slurm.yaml: one srun task per GPU, no
  torchrun): submitit marks its tasks with SUBMITIT_EXECUTOR=slurm, and SLURM gives SLURM_PROCID
  (global rank), SLURM_LOCALID, SLURM_NTASKS, SLURM_NTASKS_PER_NODE / SLURM_JOB_NUM_NODES and
  SLURM_JOB_NODELIST. The first node of the list hosts the rendezvous, on a port derived from
  SLURM_JOB_ID so every task of the job computes the same one without talking to the others.
  A plain `sbatch` script that is not submitit's is treated as one process (its batch step also has
  SLURM_PROCID=0 and SLURM_NTASKS=N, which would otherwise hang waiting for N-1 peers): use torchrun there.
- Anything else is a single process: rank 0 of 1.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

SLURM_PORT_BASE = 20000
"""MASTER_PORT under SLURM = SLURM_PORT_BASE + SLURM_JOB_ID % SLURM_PORT_SPAN (unprivileged, stable per job)."""
SLURM_PORT_SPAN = 20000


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job."""

    rank: int = 0
    local_rank: int = 0
    """Rank on this node: the CUDA device index it drives."""
    world_size: int = 1
    local_world_size: int = 1
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    launcher: str = "none"
    """torchrun | slurm | none: where the numbers came from (recorded in run.json)."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes the run dir, metrics and logs."""
        return self.rank == 0


def read_dist_env(env: Optional[Mapping[str, str]] = None) -> DistEnv:
    """DistEnv from torchrun's variables, else submitit's SLURM task variables, else a single process."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        port = env.get("MASTER_PORT")
        return _checked(DistEnv(
            rank=_int(env, "RANK"), local_rank=_int(env, "LOCAL_RANK", "0"), world_size=_int(env, "WORLD_SIZE"),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", env["WORLD_SIZE"]), master_addr=env.get("MASTER_ADDR"),
            master_port=int(port) if port else None, launcher="torchrun",
        ))
    if env.get("SUBMITIT_EXECUTOR") == "slurm" and "SLURM_PROCID" in env:
        return slurm_dist_env(env)
    return DistEnv()


def slurm_dist_env(env: Mapping[str, str]) -> DistEnv:
    """The torchrun-equivalent ranks of one SLURM task (one task per GPU)."""
    world = _int(env, "SLURM_NTASKS")
    per_node = env.get("SLURM_NTASKS_PER_NODE")
    local_world = int(per_node.split("(")[0]) if per_node else world // _int(env, "SLURM_JOB_NUM_NODES", "1")
    return _checked(DistEnv(
        rank=_int(env, "SLURM_PROCID"), local_rank=_int(env, "SLURM_LOCALID", "0"), world_size=world,
        local_world_size=local_world, master_addr=first_host(env["SLURM_JOB_NODELIST"]),
        master_port=SLURM_PORT_BASE + _int(env, "SLURM_JOB_ID") % SLURM_PORT_SPAN, launcher="slurm",
    ))


_BRACKETS = re.compile(r"^([^\[,]*)\[([^\]]+)\]([^,]*)")


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu-[003-005,9],cpu1' -> 'gpu-003', 'a1,a2' -> 'a1'.

    Zero padding is kept as written (SLURM writes '003' for host gpu-003)."""
    nodelist = nodelist.strip()
    m = _BRACKETS.match(nodelist)
    if m is None:
        host = nodelist.split(",")[0]
    else:
        prefix, ranges, suffix = m.groups()
        host = prefix + ranges.split(",")[0].split("-")[0] + suffix
    if not host:
        raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r} names no host")
    return host


def _int(env: Mapping[str, str], key: str, default: Optional[str] = None) -> int:
    value = env.get(key, default)
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{key}={value!r} is not an integer (set by the launcher: torchrun or SLURM)") from None


def _checked(d: DistEnv) -> DistEnv:
    if not (d.world_size >= 1 and 0 <= d.rank < d.world_size and 0 <= d.local_rank < d.local_world_size):
        raise ValueError(
            f"launcher env gives rank={d.rank}, local_rank={d.local_rank}, world_size={d.world_size}, "
            f"local_world_size={d.local_world_size}: need 0 <= rank < world_size and 0 <= local_rank < local_world_size"
        )
    return d
