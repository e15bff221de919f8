"""Export: compile for inference, AOTInductor/ONNX artifacts with parity checks, and one loader for all of them."""

from torchcls.export.artifact import ArtifactInfo, LoadedArtifact, load_artifact
from torchcls.export.exporter import ExportResult, export

__all__ = ["ArtifactInfo", "ExportResult", "LoadedArtifact", "export", "load_artifact"]
