"""experiments/cluster.py: a run started by a launcher is found by JAX's own detectors, and says which matched.

No processes are started here (tests/test_multiprocess.py starts two with Slurm's variables only)."""

import pytest

from experiments import cluster

SRUN = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "node[001-004,007]",
        "SLURM_NTASKS": "5", "SLURM_PROCID": "3", "SLURM_LOCALID": "0"}  # fmt: skip


def test_slurm_node_lists_expand_and_a_list_that_cannot_be_read_is_named():
    assert cluster.slurm_hosts("node[001-004,007]") == ["node001", "node002", "node003", "node004", "node007"]
    assert cluster.slurm_hosts("gpu7,a[9-11]-ib,login") == ["gpu7", "a9-ib", "a10-ib", "a11-ib", "login"]
    assert cluster.slurm_hosts("localhost") == ["localhost"]
    for bad in ("node[1-2", "node[4-2]", "a,,b", "n[x]"):
        with pytest.raises(ValueError, match="Slurm node list"):
            cluster.slurm_hosts(bad)


def test_srun_variables_are_found_by_jax_s_slurm_detector(monkeypatch):
    for k, v in SRUN.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("JAX_COORDINATOR_PORT", raising=False)
    found = cluster.detect()
    assert (found.name, found.process_id, found.process_count) == ("SlurmCluster", 3, 5)
    # JAX's own choice: the first host, a port from the job id (4242 % 4096 + 61440)
    assert found.coordinator == "node001:61586" and "SlurmCluster matched" in found.describe()
    assert cluster.launched_several()
    monkeypatch.delenv("SLURM_STEP_ID")  # the batch script's own shell (no srun step): not a multi-process start
    assert not cluster.launched_several()
