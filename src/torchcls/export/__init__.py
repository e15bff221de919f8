"""Export: inference artifacts (AOTInductor, ONNX, eager) behind one loader."""
