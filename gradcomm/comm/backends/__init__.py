"""Built-in backends. Each module is imported lazily by :mod:`gradcomm.comm.registry`."""
