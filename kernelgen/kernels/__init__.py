"""A spec's CUDA: rendering, offline compiles and their cache, generated/."""
