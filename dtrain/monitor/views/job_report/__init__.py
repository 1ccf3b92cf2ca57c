"""The post-job report: summary.json for scripts, PNG plots, report.html for people.

(A package of its own: building, summarising and plotting are three files.)
"""

from dtrain.monitor.views.job_report.build import write_report

__all__ = ["write_report"]
