"""Preflight results as typed records, and their rendering as one table.

Every problem is a `Finding` on the node that has to be fixed, with a message that says
what is wrong there and what to do; `fail` blocks a launch, `warn` does not.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class Finding(BaseModel):
    level: Literal["fail", "warn"]
    check: str  # ssh, python, torch, gpus, port, network, dns, shared, clock
    message: str


class NodeReport(BaseModel):
    node: str
    host: str
    address: str
    is_master: bool = False
    reachable: bool = False
    python: str | None = None
    python_version: str | None = None
    torch: str | None = None
    torch_cuda: str | None = None
    gpus: int | None = None
    gpu_names: list[str] = []
    driver: str | None = None
    hostname: str | None = None
    ifname: str | None = None  # for GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME
    port: str | None = None  # master: "free" / "in use"; others: "open" / "closed" (reached or not)
    reverse_lookup_s: float | None = None
    clock_skew_s: float | None = None
    shared: list[dict[str, Any]] = []
    seconds: float = 0.0
    findings: list[Finding] = []

    @property
    def ok(self) -> bool:
        return not any(f.level == "fail" for f in self.findings)

    def fail(self, check: str, message: str) -> None:
        self.findings.append(Finding(level="fail", check=check, message=message))

    def warn(self, check: str, message: str) -> None:
        self.findings.append(Finding(level="warn", check=check, message=message))


class PreflightReport(BaseModel):
    master: str
    master_address: str
    master_port: int
    nodes: list[NodeReport] = Field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(n.ok for n in self.nodes)

    @property
    def failures(self) -> list[str]:
        """One line per failing check: "node: what is wrong; what to do"."""
        return [f"{n.node}: {f.message}" for n in self.nodes for f in n.findings if f.level == "fail"]

    @property
    def warnings(self) -> list[str]:
        return [f"{n.node}: {f.message}" for n in self.nodes for f in n.findings if f.level == "warn"]

    @property
    def ifname(self) -> dict[str, str | None]:
        return {n.node: n.ifname for n in self.nodes}

    @property
    def gpus(self) -> dict[str, int | None]:
        return {n.node: n.gpus for n in self.nodes}

    def node(self, name: str) -> NodeReport:
        return next(n for n in self.nodes if n.node == name)

    def render(self, console) -> None:
        """Print the table, then one line per failure and warning, to a rich Console."""
        from rich import box
        from rich.markup import escape
        from rich.table import Table

        table = Table(title=f"preflight: master {self.master} {self.master_address}:{self.master_port}"
                            f" ({self.seconds:.1f} s)", title_justify="left", box=box.SIMPLE_HEAD,
                      show_edge=False, padding=(0, 1, 0, 0), pad_edge=False)
        for col in ("node", "ssh", "python", "torch", "GPUs", "iface", "port", "dns", "skew", "status"):
            table.add_column(col, overflow="fold")
        for n in self.nodes:
            table.add_row(*_row(n))
        console.print(table)
        # Messages quote remote output and paths: never let them be read as markup.
        for line in self.failures:
            console.print(f"[red]✗[/red] {escape(line)}", highlight=False, soft_wrap=True)
        for line in self.warnings:
            console.print(f"[yellow]![/yellow] {escape(line)}", highlight=False, soft_wrap=True)


def _row(n: NodeReport) -> list[str]:
    def mark(check: str, text: str) -> str:
        levels = {f.level for f in n.findings if f.check == check}
        if "fail" in levels:
            return f"[red]{text or 'fail'}[/red]"
        if "warn" in levels:
            return f"[yellow]{text or 'warn'}[/yellow]"
        return text

    gpus = "" if n.gpus is None else str(n.gpus)  # the driver is in --json and in a mismatch warning
    dns = "" if n.reverse_lookup_s is None else f"{n.reverse_lookup_s:.1f}s"
    skew = "" if n.clock_skew_s is None else f"{n.clock_skew_s:+.1f}s"
    status = "[green]ok[/green]" if n.ok else "[red]FAIL[/red]"
    if n.ok and n.findings:
        status = "[yellow]ok (warn)[/yellow]"
    from rich.markup import escape

    name = n.node + (" *" if n.is_master else "")
    ssh = "local" if n.host == "local" else "ok" if n.reachable else "no"
    return [name, mark("ssh", ssh), mark("python", n.python_version or ""),
            mark("torch", escape(n.torch or "")), mark("gpus", gpus), mark("network", n.ifname or ""),
            mark("port", n.port or ""), mark("dns", dns), mark("clock", skew), status]
