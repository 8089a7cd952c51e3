"""gradcomm's tests: a package, so that the harness (:mod:`tests._support`) imports by name."""
