import sys
from pathlib import Path

# Spawned children unpickle test functions by module name, so tests/ must be importable.
sys.path.insert(0, str(Path(__file__).resolve().parent))
