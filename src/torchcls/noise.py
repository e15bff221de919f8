"""Lines that libraries print during a successful command and that read as errors, silenced where they start.

Where a call of ours triggers a line, we avoid the call (a one-step cosine schedule: training/schedule.py).
Where the line is printed by a library whatever we do, exactly that line is dropped, nothing else:

- torch.utils.cpp_extension logs "No CUDA runtime is found, using CUDA_HOME=..." when it is first imported
  (AOTInductor export, serving a .pt2) on a machine with a CUDA toolkit and no GPU: nothing needs CUDA then.
- torch.utils._pytree logs that registering an Enum as a pytree constant is deprecated when torchao
  (ExecuTorch int8, FP8) registers its own enums at import: torchao's to change, not the user's.
- The ExecuTorch runtime's XNNPACK threadpool logs five "[cpuinfo_utils.cpp] ... Failed to open midr file"
  lines when a .pte is loaded on a CPU that is not an ARM big.LITTLE one (it looks for ARM core ids).
- The profiler behind `--memory-report` on a CPU-only machine (kineto in a CUDA build of torch) logs
  "ERROR: gpuGetDeviceCount failed with code 35" and its profiler_start/stop stages.
The last two come from C++ straight to file descriptor 2, so they are filtered there, around the calls
that print them only (stderr_without).
- Building an int8 .pt2 (artifacts/targets/aoti.py) warns twice per package from library code: torchao's
  X86InductorQuantizer that a max pool after a grey-scale stem (kept in fp32 on purpose:
  quantize.single_channel_convolutions) is left unquantized, and Inductor's oneDNN int8 lowering that it
  copy-constructs a tensor. Both are ignored around those calls only (warnings_without), by module and text.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator

# (logger, text of the one message dropped from it)
LOGGED = (("torch.utils.cpp_extension", "No CUDA runtime is found"),
          ("torch.utils._pytree", "is an Enum subclass and is now natively supported"))
EXECUTORCH_CPUINFO = re.compile(r"\[cpuinfo_utils\.cpp:\d+\]")
KINETO_CPU_ONLY = re.compile(r"gpuGetDeviceCount failed with code|SyncActivityProfilerHandler\.cpp:\d+\] profiler_")
# (module that warns, start of the one warning ignored)
INT8_QUANTIZER = (("torchao.quantization.pt2e.quantizer.x86_inductor_quantizer",
                   "The input of maxpool2d is not quantized"),)
INT8_LOWERING = (("torch._inductor.mkldnn_lowerings", "To copy construct from a tensor"),)


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def silence_known_noise() -> None:
    """Install the logging filters above (once; cheap: no library is imported)."""
    for name, text in LOGGED:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.text == text for f in logger.filters):
            logger.addFilter(_DropMessage(text))


@contextlib.contextmanager
def warnings_without(known: tuple[tuple[str, str], ...]) -> Iterator[None]:
    """Run the body ignoring the UserWarnings in `known` (module, start of the message); every other warning,
    and these outside the body, behave as the process's filters say."""
    with warnings.catch_warnings():
        for module, text in known:
            warnings.filterwarnings("ignore", message=re.escape(text), category=UserWarning,
                                    module=re.escape(module) + "$")
        yield


@contextlib.contextmanager
def stderr_without(pattern: re.Pattern[str]) -> Iterator[None]:
    """Run the body with file descriptor 2 captured; afterwards write back every line but those matching
    `pattern`. For native code that prints to stderr; the body must be short (its other stderr output,
    Python's included, is shown when it ends, and in full if it raises)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().decode(errors="replace").splitlines(keepends=True)
                    if not pattern.search(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
