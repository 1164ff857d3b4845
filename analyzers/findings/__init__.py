"""Stage 4: attributed starved time ranked into findings, with the Python frames at both ends."""
