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


def test_a_survivor_names_the_phase_and_the_step_and_says_when_jax_named_no_peer():
    """experiments/supervise.py's closing line, from the child's status and log (no processes: the multi-process
    test kills a real peer inside a save)."""
    from experiments import supervise
    from shardkit.checkpoint import SaveError

    status = {"process": 0, "processes": 2, "step": 12, "checkpoint": 6, "checkpoints": "/r/checkpoints",
              "heartbeat_timeout": 5, "phase": "checkpoint save", "phase_step": 12}  # fmt: skip
    abort = "F0000 ... Task 1 heartbeat timeout ... another task died\nFatal Python error: Aborted\n"
    line, rc = supervise.verdict(-6, status, abort, said_error=False, forwarded=False)  # JAX's abort: SIGABRT
    assert rc == 75 and line.startswith("error: process 0: process 1 of 2 stopped (no heartbeat for 5 s"), line
    assert "after step 12, during the checkpoint save of step 12. Rerun" in line and "from step 6 (" in line
    # the collective failed first and JAX never said which peer: said so, still 75
    quiet = {**status, "collective_error": "UNKNOWN: Gloo AllGather failed: Connection closed by peer"}
    line, rc = supervise.verdict(75, quiet, "collective failed (a peer is gone)\n", False, False)
    assert rc == 75 and "a peer process (of 2; JAX named none) stopped" in line, line
    # a synced stop (SIGTERM from JAX's notifier, the Ctrl-C was on another host) is no error
    assert supervise.verdict(143, {**status, "stopped": "SIGTERM"}, "", False, False) == ("", 143)
    # ended before it read the run: no step is invented
    assert "the run's newest checkpoint" in supervise.resume_from({})
    try:
        try:
            raise RuntimeError("UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:534]")
        except RuntimeError as e:
            raise SaveError("saving checkpoint step 10 failed") from e
    except SaveError as e:
        assert supervise.collective_failure(e)
    assert not supervise.collective_failure(ValueError("steps=-1 must be >= 0"))
