"""Launcher environment -> ranks (torchrun, submitit's SLURM tasks), the checks at process-group
setup, rank-0-only Hydra files, and the SLURM launcher config composing with the submitit plugin."""

from __future__ import annotations

import pytest
import torch

from kimik3.distributed import DistEnv, hydra_rank_overrides, read_dist_env, setup_distributed
from kimik3.distributed.env import SLURM_PORT_BASE, first_host

TORCHRUN = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "node7", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none"}
SLURM_TASK = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8",
              "SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu-[007-008]",
              "SLURM_JOB_ID": "123456"}


def test_torchrun_variables_give_the_ranks():
    assert read_dist_env(TORCHRUN) == DistEnv(rank=3, local_rank=1, world_size=4, local_world_size=2,
                                              master_addr="node7", master_port=29500, launcher="torchrun")


def test_submitit_slurm_task_maps_to_torchrun_ranks():
    d = read_dist_env(SLURM_TASK)
    assert (d.rank, d.local_rank, d.world_size, d.local_world_size) == (5, 1, 8, 4)
    assert d.master_addr == "gpu-007" and d.launcher == "slurm"
    assert d.master_port == SLURM_PORT_BASE + 123456 % 20000
    assert read_dist_env({**SLURM_TASK, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}).master_port == d.master_port


def test_slurm_tasks_per_node_from_node_count_and_torchrun_winning():
    no_per_node = {k: v for k, v in SLURM_TASK.items() if k != "SLURM_NTASKS_PER_NODE"}
    assert read_dist_env(no_per_node).local_world_size == 4
    assert read_dist_env({**SLURM_TASK, "SLURM_NTASKS_PER_NODE": "4(x2)"}).local_world_size == 4
    assert read_dist_env({**SLURM_TASK, **TORCHRUN}).launcher == "torchrun"  # torchrun inside an allocation


def test_plain_sbatch_script_and_no_launcher_are_one_process():
    batch_step = {k: v for k, v in SLURM_TASK.items() if k != "SUBMITIT_EXECUTOR"}
    assert read_dist_env(batch_step) == DistEnv()
    assert read_dist_env({}) == DistEnv() and DistEnv().is_main


@pytest.mark.parametrize("nodelist, host", [
    ("gpu-[003-005,9],cpu1", "gpu-003"), ("a1,a2", "a1"), ("solo", "solo"), ("rack[12]-gpu", "rack12-gpu"),
])
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.parametrize("env, message", [
    ({**TORCHRUN, "RANK": "4"}, "need 0 <= rank < world_size"),
    ({**TORCHRUN, "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
])
def test_bad_launcher_values_are_one_clear_line(env, message):
    with pytest.raises(ValueError, match=message):
        read_dist_env(env)


def test_parallel_must_fit_the_launch():
    with pytest.raises(ValueError, match="2 processes were launched .* but train.parallel=none"):
        setup_distributed("none", torch.device("cpu"), DistEnv(rank=0, world_size=2, local_world_size=2,
                                                               launcher="torchrun"))
    with pytest.raises(ValueError, match="train.parallel=fsdp needs a distributed launch: torchrun"):
        setup_distributed("fsdp", torch.device("cpu"), DistEnv())
    assert setup_distributed("none", torch.device("cpu"), DistEnv()).backend is None


def test_only_rank_zero_writes_hydra_files():
    assert hydra_rank_overrides(DistEnv()) == []
    assert hydra_rank_overrides(read_dist_env(TORCHRUN)) == ["hydra.output_subdir=null"]


def test_slurm_launcher_config_composes_one_task_per_gpu():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="needs pip install 'kimik3[slurm]'")
    from hydra import compose, initialize_config_dir

    from kimik3.config.store import register_configs
    from kimik3.runs.run_dir import register_resolvers
    from kimik3.train import CONF_DIR, CONFIG_NAME

    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
        cfg = compose(CONFIG_NAME, return_hydra_config=True, overrides=[
            "hydra/launcher=slurm", "hydra.launcher.nodes=2", "hydra.launcher.gpus_per_node=4",
            "hydra.launcher.partition=gpu", "hydra.launcher.timeout_min=30", "train.parallel=fsdp"])
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.nodes, launcher.gpus_per_node, launcher.tasks_per_node) == (2, 4, 4)
    assert (launcher.partition, launcher.timeout_min) == ("gpu", 30)


def test_ranks_above_zero_log_to_their_own_file_only_when_asked(tmp_path):
    import logging

    from kimik3.distributed import configure_rank_logging

    root = logging.getLogger()
    saved = list(root.handlers)
    hydra_file, console = logging.FileHandler(tmp_path / "train.log"), logging.StreamHandler()
    root.handlers[:] = [hydra_file, console]
    try:
        configure_rank_logging(DistEnv(), tmp_path, environ={})
        assert root.handlers == [hydra_file, console]  # rank 0 keeps Hydra's logging
        configure_rank_logging(DistEnv(rank=1, world_size=2, local_rank=1, local_world_size=2), tmp_path,
                               environ={"KIMIK3_RANK_LOGS": "1"})
        assert console in root.handlers and console.level == logging.WARNING and hydra_file not in root.handlers
        (own,) = [h for h in root.handlers if isinstance(h, logging.FileHandler)]
        logging.getLogger("kimik3").warning("from rank one")
        own.flush()
        assert "[rank 1] from rank one" in (tmp_path / "train.rank1.log").read_text()
    finally:
        for h in root.handlers:
            if h not in saved:
                h.close()
        root.handlers[:] = saved
