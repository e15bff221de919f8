"""Checkpoints: safetensors weights with their metadata, weights-only training state, sharded DCP."""
