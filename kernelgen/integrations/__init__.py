"""kernelgen inside other libraries (each submodule imports its library; none is imported here).

- :mod:`kernelgen.integrations.transformers`: ``attn_implementation="kernelgen"`` for Hugging
  Face transformers models.
"""
