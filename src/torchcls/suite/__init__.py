"""The measurement suite behind `torchcls bench compile|memory`: compile gains per backbone, per-rank
memory as the world grows (the repo's top-level benchmarks/ are scripts that publish figures)."""
