"""Reading a TOML file named by input (a training config, a run dir's config.toml, a policy): its size
and shape are bounded before tomllib parses it, and the result is plain data (str, int, float, bool,
dates, lists, tables): nothing in it is ever turned into code.

tomllib's cost is not linear in every input, so a small file could stop or crash a run:
- a dotted key of k parts costs it O(k^2) memory and time (every prefix of the key is kept as its own
  tuple until the next table header): a 20 KB line `a.a.a... = 1` (10,000 parts) takes 400 MB and 3 s,
  one of 60 KB about 3.5 GB;
- nesting deeper than about 490 arrays or inline tables raises RecursionError, not a TOML error;
- an integer of more than 4300 digits raises Python's raw ValueError.
One linear scan (strings and comments skipped as TOML defines them) bounds the dots on a line and the
brackets open at once before tomllib runs; every parse failure becomes a UserError naming the file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from torchcls.errors import UserError
from torchcls.io_files import read_text
from torchcls.toml_compat import tomllib

MAX_TOML_BYTES = 256 * 1024  # a config or policy is a few KB
MAX_NESTING = 32  # arrays / inline tables / table-header brackets open at once, outside strings
MAX_DOTS_PER_LINE = 32  # '.' outside strings and comments on one line: dotted-key parts and float points

_OUTSIDE = re.compile(r'"""|\'\'\'|["\'#\[\]{}.\n]')
# How each kind of string ends (a backslash escapes the next character in basic strings only; a
# single-line string never crosses a newline: where it would, tomllib refuses the file anyway).
_CLOSE = {'"': re.compile(r'\\.|"|\n', re.S), '"""': re.compile(r'\\.|"""', re.S),
          "'": re.compile(r"'|\n"), "'''": re.compile("'''")}


def read_toml(path: str | Path, what: str, invalid: str = "is not valid TOML") -> dict[str, Any]:
    """The tables of the TOML file `path` (a regular file of at most MAX_TOML_BYTES, strict UTF-8, so no
    lone surrogate either), checked against the bounds above; UserError "`what` `path` `invalid`: ..."
    when it does not parse."""
    text = read_text(path, max_bytes=MAX_TOML_BYTES, what=what)
    origin = f"{what} {path}"
    check_shape(text, origin)
    try:
        raw = tomllib.loads(text)
    except (ValueError, RecursionError) as e:  # TOMLDecodeError is a ValueError, as is a too-long integer
        raise UserError(f"{origin} {invalid}: {e}") from None
    return raw


def check_shape(text: str, origin: str) -> None:
    """Refuse (UserError) a document with more than MAX_DOTS_PER_LINE dots on a line or more than
    MAX_NESTING brackets open at once, counted outside strings and comments; linear in len(text)."""
    depth = dots = pos = 0
    line = 1
    while m := _OUTSIDE.search(text, pos):
        tok, pos = m.group(), m.end()
        if tok == "\n":
            line, dots = line + 1, 0
        elif tok == ".":
            dots += 1
            if dots > MAX_DOTS_PER_LINE:
                raise UserError(f"{origin}: line {line} has more than {MAX_DOTS_PER_LINE} dotted-key parts "
                                "(or numbers with a point); a torchcls config or policy needs a few")
        elif tok in "[{":
            depth += 1
            if depth > MAX_NESTING:
                raise UserError(f"{origin}: line {line} nests arrays or tables more than {MAX_NESTING} deep")
        elif tok in "]}":
            depth = max(0, depth - 1)
        elif tok == "#":  # a comment runs to the end of the line (the newline itself is still counted)
            end = text.find("\n", pos)
            pos = len(text) if end < 0 else end
        else:
            start, pos = pos, _string_end(text, pos, tok)
            line += text.count("\n", start, pos)


def _string_end(text: str, pos: int, opener: str) -> int:
    """The index just past the string opened by `opener` before `pos` (or where it runs off)."""
    close = _CLOSE[opener]
    while m := close.search(text, pos):
        tok = m.group()
        if tok.startswith("\\"):
            pos = m.end()
            continue
        if tok == "\n":
            return m.start()
        end = m.end()
        if len(opener) == 3:  # a multi-line string may end in one or two quotes of its own: `""""` `"""""`
            for _ in range(2):
                end += text.startswith(opener[0], end)
        return end
    return len(text)
