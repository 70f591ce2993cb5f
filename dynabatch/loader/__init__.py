"""dynabatch/loader."""
