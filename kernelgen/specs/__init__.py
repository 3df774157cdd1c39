"""The specs: forward and backward families, architectures, engines, expressions."""
