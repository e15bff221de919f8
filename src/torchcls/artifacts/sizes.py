"""How much an artifact's graph may make its runtime allocate per image: one allowance that the `.onnx` and
`.pte` checks (`onnx_bounds`, `pte_bounds`) share, so the two targets state the same bound.

An honest classifier's activations are a small multiple of its input: resnet50 at 224 px peaks at 5.3 x the
input's elements per image, SmallNet at 32 px at 5.3 x; a 100,000-class head on 28 x 28 images makes logits
of 128 x its input, which the floor covers.
"""

from __future__ import annotations

IMAGE_FACTOR = 256  # elements per image: 256 x the image's own C x H x W ...
IMAGE_FLOOR = 2**22  # ... or 4M (16 MiB of float32), whichever is larger


def value_bound(batch: int, channels: int, size: int) -> int:
    """The most elements one value of the graph may hold when it runs on `batch` images."""
    return batch * max(IMAGE_FACTOR * channels * size * size, IMAGE_FLOOR)
