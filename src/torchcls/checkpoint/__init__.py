"""Checkpoints: `Checkpointer` (checkpointer.py) owns what a run saves and resumes; files.py the
file names and the single-file formats (safetensors weights with metadata, weights-only training
state); dcp.py the sharded format of torchrun runs."""
