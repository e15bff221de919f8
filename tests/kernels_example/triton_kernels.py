"""A Triton kernel, as a GPU kernel author would ship it (compiled at first launch for the local GPU)."""

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: without it there is simply no Triton kernel to audit
    triton = None

if triton is not None:

    @triton.jit
    def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + tl.load(y_ptr + offsets, mask=mask),
                 mask=mask)
