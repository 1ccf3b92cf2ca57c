"""The Slurm test cluster itself: a 2-node step runs one task on each of two netns hosts."""

import pytest

pytestmark = [pytest.mark.netns, pytest.mark.slow]


def test_two_node_step_runs_one_task_on_each_host(slurm_cluster):
    res = slurm_cluster.cmd("srun", "-N2", "--ntasks-per-node=1", "-p", slurm_cluster.partition,
                            "sh", "-c", "echo $SLURMD_NODENAME $(hostname -I)", timeout=60)
    assert res.returncode == 0, res.stderr
    # Slurm picks any two idle nodes of the (session-wide, 3-node) cluster: an earlier test
    # may leave one completing, so which two is not ours to fix; that each task ran on a
    # different node, inside that node's own namespace, is.
    address = {h.name: h.address for h in slurm_cluster.netns.hosts}
    tasks = [line.split() for line in res.stdout.splitlines() if line.strip()]
    assert len(tasks) == 2, res.stdout
    assert len({name for name, _ in tasks}) == 2, res.stdout
    for name, addr in tasks:
        assert address.get(name) == addr, res.stdout
