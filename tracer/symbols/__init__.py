"""Naming what the probes saw: native stacks and addresses (ELF symbols, memory regions) and CPython frames."""
