"""Jinja2 templates of the generated CUDA kernels (shipped in the wheel as ``kernelgen.templates``)."""
