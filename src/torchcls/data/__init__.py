"""Data: sources (built-in sets, ImageFolder, CSV), transforms and loaders."""

from torchcls.data.loaders import DataBundle, Preprocess, build_data, build_transform, eval_dataset, make_loader
from torchcls.data.skips import BadSampleError, read_skips
from torchcls.data.sources import ImageSet, open_source

__all__ = ["BadSampleError", "DataBundle", "ImageSet", "Preprocess", "build_data", "build_transform",
           "eval_dataset", "make_loader", "open_source", "read_skips"]
