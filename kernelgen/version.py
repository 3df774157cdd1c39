"""kernelgen's version, in a module of its own so that any module can read it without importing
the package (whose ``__init__`` imports the API, and with it most of kernelgen)."""

__version__ = "0.1.0"
