"""Scripts run under ``mpiexec`` (by path, the repository root on PYTHONPATH)."""
