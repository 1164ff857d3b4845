"""The BPF collectors: one module per probe in probes/ (same name), which turns its ring buffer and map records into trace rows."""
