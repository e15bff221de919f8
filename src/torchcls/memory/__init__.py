"""Memory measurement: the CUDA caching allocator report (and its CPU stand-in) for training runs."""
