"""The folder an export publishes into, made for the attempt and taken back when the attempt fails.

--precision auto first builds bf16 into export/<target>-bf16/; when that artifact fails parity, fp32 is
built into export/<target>-fp32/, and the bf16 folder, empty, stayed behind as if something had been
exported there. Here the folders an attempt made are removed again when it fails, innermost first, but
only folders this process made (made_dirs: the inode it created, not just the name) and only while
empty (rmdir refuses anything else), so nothing another export or the user put there is touched.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from torchcls.errors import UserError
from torchcls.made_dirs import MadeDir, make_dir


@contextlib.contextmanager
def attempt_folder(folder: Path) -> Iterator[Path]:
    """`folder`, created with its missing parents; those this call made are removed if the body raises."""
    made = _make_missing(folder)
    try:
        yield folder
    except BaseException:
        for d in reversed(made):
            if d.still_here():
                with contextlib.suppress(OSError):  # not empty: something was put there meanwhile, kept
                    os.rmdir(d.path)
        raise


def _make_missing(folder: Path) -> list[MadeDir]:
    missing = []
    p = folder
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    made = []
    for d in reversed(missing):
        try:
            made.append(make_dir(d))
        except FileExistsError:  # made by another process meanwhile: used, never removed
            continue
        except NotADirectoryError:
            break
    if not folder.is_dir():
        raise UserError(f"{folder}: the artifact's folder cannot be made there (a file of that name, or one of "
                        "its parents, is in the way): choose another --out")
    return made
