"""The public calls behind kernelgen.attention & co: checks, plans, launches."""
