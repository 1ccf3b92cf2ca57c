"""The post-job report: summary.json for scripts, PNG plots, report.html for people.

(A package of its own because `dtrain.monitor.report` is the per-step reporting API.)
"""

from dtrain.monitor.jobreport.build import write_report

__all__ = ["write_report"]
