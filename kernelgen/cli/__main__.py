"""``python -m kernelgen.cli``: the ``kernelgen`` command."""

from kernelgen.cli import main

main()
