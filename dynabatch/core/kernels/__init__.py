"""dynabatch/core/kernels."""
