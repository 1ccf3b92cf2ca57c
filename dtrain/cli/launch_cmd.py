"""The launch side of the cluster commands (run, jobs, status, logs, stop).

Owner: launch. Registered from cluster_cmd.register so that the cluster and launch
commands stay together in `dtrain --help` while living in separate files.
"""

from __future__ import annotations

import sys
from typing import Optional

import typer

_RUN_HELP = """Run a command on every node of a cluster with torchrun (fail-fast, logs, registry).

[bold]dtrain run cluster.yaml -- python train.py --epochs 3[/bold]

[bold]dtrain run --hosts gpu1,gpu2 --nproc-per-node 2 -- python train.py[/bold]

[bold]dtrain run cluster.yaml --rdzv elastic --nnodes 1:2 --max-restarts 1 -- dtrain train cfg.yaml[/bold]

The first word after the options is the cluster file when it ends in .yaml/.yml; the rest
is the command (or give it in --job job.yaml). Without a cluster: this machine only."""


def register(app: typer.Typer) -> None:
    @app.command(
        "run", help=_RUN_HELP,
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )
    def run(
        ctx: typer.Context,
        hosts: Optional[str] = typer.Option(None, "--hosts", help="Comma-separated SSH hosts (or 'local')."),
        ssh_config: Optional[str] = typer.Option(None, "--ssh-config", help="ssh client config (ssh -F) instead of ~/.ssh/config."),
        nproc_per_node: Optional[int] = typer.Option(None, "--nproc-per-node", help="Processes per node."),
        rdzv: Optional[str] = typer.Option(None, "--rdzv", help="static (default) or elastic."),
        nnodes: Optional[str] = typer.Option(None, "--nnodes", help="Elastic MIN:MAX nodes."),
        max_restarts: Optional[int] = typer.Option(None, "--max-restarts", help="Elastic restarts (Slurm: requeues)."),
        port: Optional[int] = typer.Option(None, "--port", help="Master / rendezvous port."),
        hang_timeout: Optional[float] = typer.Option(None, "--hang-timeout", help="Seconds without progress."),
        env: list[str] = typer.Option([], "--env", help="K=V for every rank (repeatable)."),
        secret_env: list[str] = typer.Option(
            [], "--secret-env",
            help="NAME: pass this variable of your shell to every rank as a secret (never written to disk).",
        ),
        name: Optional[str] = typer.Option(None, "--name", help="Job name."),
        job_file: Optional[str] = typer.Option(None, "--job", help="job.yaml with the job description."),
        no_preflight: bool = typer.Option(False, "--no-preflight", help="Skip the preflight checks."),
        detach: bool = typer.Option(False, "--detach", help="Run under a background supervisor."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Print each node's command and env."),
        tf_config: bool = typer.Option(False, "--tf-config", help="Also export TF_CONFIG."),
        no_sync: bool = typer.Option(False, "--no-sync", help="Do not copy the working directory."),
        no_monitor: bool = typer.Option(False, "--no-monitor", help="Do not start the node agents."),
        down: bool = typer.Option(False, "--down", help="Rented cluster: terminate it when the job ends."),
        max_replacements: int = typer.Option(0, "--max-replacements",
                                             help="Rented cluster, elastic: replace up to K lost instances."),
        slurm_partition: Optional[str] = typer.Option(None, "--slurm-partition", help="Submit to this Slurm partition."),
        slurm_nodes: Optional[int] = typer.Option(None, "--nodes", help="Slurm nodes to allocate."),
        requeue: bool = typer.Option(False, "--requeue", help="Slurm: requeue the job when a node fails."),
    ) -> None:
        from dtrain.cluster.providers.lifecycle import rented_cluster
        from dtrain.cluster.providers.replace import replacer_for
        from dtrain.cluster.spec import cluster_from_args
        from dtrain.errors import ConfigError
        from dtrain.launch.cli_support import job_from, print_and_exit
        from dtrain.launch.launcher import start
        from dtrain.launch.slurm import slurm_from_args

        words = list(ctx.args)
        cluster_file = words.pop(0) if words and words[0].endswith((".yaml", ".yml")) else None
        slurm = slurm_from_args(cluster_file, hosts, slurm_partition, slurm_nodes, requeue)
        if slurm is not None and max_restarts and rdzv is None:
            rdzv = "elastic"  # a Slurm job's rendezvous is c10d; its restarts are requeues
        job = job_from(
            job_file, words, name=name, nproc_per_node=nproc_per_node, rdzv=rdzv, nnodes=nnodes,
            max_restarts=max_restarts, port=port, hang_timeout=hang_timeout, env=env,
            secret_env=secret_env or None,
            tf_config=tf_config or None, sync="never" if no_sync else None,
            monitor=False if no_monitor else None,
        )
        if down and detach:
            raise ConfigError("--down and --detach together would release the cluster under the running job",
                              "drop one of them")
        with rented_cluster(cluster_file, release=down, dry_run=dry_run, echo=typer.echo) as rented:
            cluster = slurm or rented or cluster_from_args(cluster_file, hosts, ssh_config=ssh_config, default_local=True)
            started = start(job, cluster, out=sys.stdout, run_preflight=not no_preflight,
                            dry_run=dry_run, detach=detach,
                            replacer=replacer_for(cluster_file, job, max_replacements, detach, typer.echo))
        print_and_exit(started.exit_status)

    @app.command("jobs")
    def jobs(
        as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
        limit: int = typer.Option(50, "--limit", help="Show at most this many jobs."),
    ) -> None:
        """List jobs, newest first."""
        from dtrain.jobs.views import show_jobs

        show_jobs(as_json=as_json, limit=limit)

    @app.command("status")
    def status(
        job: str = typer.Argument(..., help="Job id (or a unique prefix, or its name)."),
        as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    ) -> None:
        """Show one job: state, nodes, world size, timing, exit code, reason."""
        from dtrain.jobs.views import show_status

        show_status(job, as_json=as_json)

    @app.command("logs")
    def logs(
        job: str = typer.Argument(..., help="Job id (or a unique prefix, or its name)."),
        follow: bool = typer.Option(False, "-f", "--follow", help="Keep printing until the job ends."),
        node: Optional[str] = typer.Option(None, "--node", help="Only this node's log."),
    ) -> None:
        """Print a job's output (all nodes interleaved, or one node)."""
        from dtrain.jobs.views import show_logs

        show_logs(job, follow=follow, node=node)

    @app.command("stop")
    def stop(
        job: str = typer.Argument(..., help="Job id (or a unique prefix, or its name)."),
        wait: float = typer.Option(45.0, "--wait", help="Seconds to wait for the job to end."),
    ) -> None:
        """Stop a running job on every node (its supervisor stops all of them)."""
        from dtrain.jobs.views import stop_job

        stop_job(job, wait=wait)
