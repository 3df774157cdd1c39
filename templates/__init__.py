"""Jinja2 templates of the generated CUDA kernels (shipped as ``kernelgen.templates``)."""
