"""The Slurm test cluster itself: a 2-node step runs one task on each of two netns hosts."""

import pytest

pytestmark = [pytest.mark.netns, pytest.mark.slow]


def test_two_node_step_runs_one_task_on_each_host(slurm_cluster):
    res = slurm_cluster.cmd("srun", "-N2", "--ntasks-per-node=1", "-p", slurm_cluster.partition,
                            "sh", "-c", "echo $SLURMD_NODENAME $(hostname -I)", timeout=60)
    assert res.returncode == 0, res.stderr
    hosts = slurm_cluster.netns.hosts
    assert sorted(res.stdout.split()) == sorted([hosts[0].name, hosts[0].address, hosts[1].name, hosts[1].address])
