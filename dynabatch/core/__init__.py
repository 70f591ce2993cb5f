"""dynabatch/core."""
