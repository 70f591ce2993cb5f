"""dynabatch/planfile."""
