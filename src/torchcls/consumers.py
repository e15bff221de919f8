"""The consumers that hear the core's events (torchcls.events) in every process: governance and the report.

Connected once, when torchcls is imported (torchcls/__init__.py), so that the CLI, the Python API and any
caller of a core function (`torchcls.training.train`, `torchcls.artifacts.export`, ...) get the same audit
records, refusals and report files. Order matters where two hear one event: governance finishes a run
(governance.json, the audit record) before the report, which shows it, is written.

Each handler imports its consumer when its first event arrives: `import torchcls` stays fast.
"""

from __future__ import annotations

from torchcls.events import ArtifactExported, EvaluationWritten, RunFinished, RunStarted, subscribe

_connected: list[bool] = []


def connect() -> None:
    """Subscribe the consumers (once per process)."""
    if _connected:
        return
    _connected.append(True)
    subscribe(RunStarted, _govern_run)
    subscribe(RunFinished, _record_run)
    subscribe(RunFinished, _report_run)
    subscribe(ArtifactExported, _register_artifact)
    subscribe(EvaluationWritten, _report_evaluation)


def _govern_run(event: RunStarted) -> None:
    from torchcls.governance.run import on_run_started

    on_run_started(event)


def _record_run(event: RunFinished) -> None:
    from torchcls.governance.run import on_run_finished

    on_run_finished(event)


def _report_run(event: RunFinished) -> None:
    from torchcls.report.subscriber import on_run_finished

    on_run_finished(event)


def _register_artifact(event: ArtifactExported) -> None:
    from torchcls.governance.artifacts import on_artifact_exported

    on_artifact_exported(event)


def _report_evaluation(event: EvaluationWritten) -> None:
    from torchcls.report.subscriber import on_evaluation_written

    on_evaluation_written(event)
