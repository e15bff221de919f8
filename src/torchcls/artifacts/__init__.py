"""Export: compile for inference, AOTInductor/ONNX artifacts with parity checks, and one loader for all of them."""

from torchcls.artifacts.artifact import ArtifactInfo, LoadedArtifact, load_artifact
from torchcls.artifacts.compile import CompiledClassifier, compile_for_inference
from torchcls.artifacts.exporter import ExportResult, export

__all__ = ["ArtifactInfo", "CompiledClassifier", "ExportResult", "LoadedArtifact", "compile_for_inference", "export",
           "load_artifact"]
