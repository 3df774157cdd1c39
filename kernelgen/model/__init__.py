"""The static performance model and the default specs it picks."""
