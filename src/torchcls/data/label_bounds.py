"""Bounds on the classes and labels a data source declares, checked before anything in proportion is built.

A source's class count is a number its files choose: one integer label of 10**12 in a Parquet file asked
for 10**12 class names, one CSV row listing 15,000 labels made a 2.4 GB target matrix from 229 KB. Every
source (folders, CSV manifests, Hugging Face tables, shards) checks its count here, with the bound a model
head is built under (`MAX_CLASSES`, here: models/registry.py checks every ModelSpec against it too), so nothing
trains that could not be saved.
"""

from __future__ import annotations

from collections.abc import Iterable

from torchcls.errors import UserError

# ImageNet-21k, the largest common label set, has 21,841; 100k leaves room while the head of a 2048-wide
# backbone stays under 1 GB in fp32.
MAX_CLASSES = 100_000
MAX_CLASS_NAME = 1_024  # characters of one class name: what checkpoint metadata accepts (meta_check.py)
MAX_LABELS_PER_ROW = 1_000  # labels one multi-label CSV row lists (tag data sets list tens)
# A multi-label set's targets are a dense float32 (samples x classes) matrix: 2**28 of them is 1 GiB.
MAX_TARGET_ELEMENTS = 2**28

__all__ = ["MAX_CLASSES", "MAX_CLASS_NAME", "MAX_LABELS_PER_ROW", "MAX_TARGET_ELEMENTS", "check_class_count",
           "check_class_names", "check_label_index", "check_multilabel_size"]


def check_class_count(count: int, where: str, what: str = "classes") -> None:
    """Refuse more than MAX_CLASSES classes (`what` says what was counted: "class folders", "labels"...)."""
    if count > MAX_CLASSES:
        raise UserError(f"{where}: {count:,} {what}, more than the {MAX_CLASSES:,} classes a model is built for "
                        "(torchcls.data.label_bounds.MAX_CLASSES): is it the right data, or the right label column?")


def check_label_index(top: int, where: str) -> None:
    """Integer labels name classes 0..top: refuse a top that would ask for more than MAX_CLASSES classes,
    before a name is made for each."""
    if top >= MAX_CLASSES:
        raise UserError(f"{where}: label {top:,}, but integer labels are class indexes 0 to {MAX_CLASSES - 1:,} "
                        "(torchcls.data.label_bounds.MAX_CLASSES): is it the right label column?")


def check_class_names(names: Iterable[str], where: str) -> None:
    """Each class name at most MAX_CLASS_NAME characters (checked after check_class_count has bounded how many):
    a checkpoint could not record a longer one, so training would fail only when it saves."""
    long = next((n for n in names if len(n) > MAX_CLASS_NAME), None)
    if long is not None:
        raise UserError(f"{where}: a class name of {len(long):,} characters ({long[:40]!r}...); class names are "
                        f"at most {MAX_CLASS_NAME:,} characters")


def check_multilabel_size(rows: int, classes: int, where: str) -> None:
    """The (rows x classes) float32 target matrix of a multi-label source, bounded before it is allocated."""
    check_class_count(classes, where, "distinct labels")
    if rows * classes > MAX_TARGET_ELEMENTS:
        raise UserError(f"{where}: {rows:,} images x {classes:,} labels is {rows * classes:,} targets, more than "
                        f"{MAX_TARGET_ELEMENTS:,} (a 1 GiB float32 matrix, the most a multi-label set is held as): "
                        "split the data or use fewer labels")
