"""Float64 NumPy references and example inputs (for tests and checks)."""
