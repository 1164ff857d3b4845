import sys
from pathlib import Path

# Test helpers (kernel_env, recording, synth, ...) import as top-level modules.
sys.path.insert(0, str(Path(__file__).parent))
