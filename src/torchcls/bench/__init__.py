"""Benchmarks as commands: `torchcls bench compile` (compile gains per backbone)."""
