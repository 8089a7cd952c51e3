"""The test harness: launching ranks (:mod:`.dist_utils`, :mod:`.ranks`), the libraries of
cases the test modules run on them, fakes for GPU paths, simulated hosts; ``mpi_scripts/`` and
``multihost_scripts/`` hold the scripts started under ``mpiexec`` and on simulated hosts."""
