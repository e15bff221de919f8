"""Export: compile for inference, AOTInductor/ONNX artifacts with parity checks, and one loader for all of them."""

from torchcls.export.artifact import ArtifactInfo, LoadedArtifact, load_artifact

__all__ = ["ArtifactInfo", "LoadedArtifact", "load_artifact"]
