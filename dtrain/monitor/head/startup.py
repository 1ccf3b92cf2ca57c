"""What the launcher needs to start monitoring for a job (no heavy imports here).

On every node:   runner.popen(agent_argv(job, node.name, node.address, port, node.python),
                              stdin=PIPE)          # the agent ends when stdin closes
In every rank's environment:   agent_env(port)    # report_step -> that node's agent
On the head:     Collector(job_dir, {node.name: agent_url(node.address, port)}).start()
"""

from __future__ import annotations

DEFAULT_PORT = 9464


def agent_argv(job_id: str, node: str, bind: str, port: int = DEFAULT_PORT, python: str = "python3",
               *, interval_s: float = 1.0) -> list[str]:  # fmt: skip
    # Niced: the agent must never take cycles from the job it watches. Its own start
    # (~0.4 CPU-s of imports) coincides with torchrun starting the ranks; at full
    # priority it delayed the first step by 1-2 s where nodes share few cores.
    return [
        "nice", "-n", "10", python, "-m", "dtrain.monitor.node.agent",
        "--job", job_id, "--node", node, "--bind", bind, "--port", str(port),
        "--interval", str(interval_s), "--exit-on-stdin-close",
    ]  # fmt: skip


def agent_env(port: int = DEFAULT_PORT) -> dict[str, str]:
    """Ranks reach the agent of their own node over loopback UDP on the agent's port."""
    return {"DTRAIN_AGENT_ADDR": f"127.0.0.1:{port}"}


def agent_url(address: str, port: int = DEFAULT_PORT) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"
