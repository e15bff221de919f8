"""Plots and the HTML run report."""

from torchcls.report.html import write_report

__all__ = ["write_report"]
