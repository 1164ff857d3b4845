"""Stage 4: attributed starved time ranked into findings with their evidence."""
