"""The MPI backend: collectives over mpi4py, on CPU tensors and CUDA buffers.

One concept per module: :mod:`.communicator` (the :class:`MPICommunicator` and its capability
table), :mod:`.progress` (the thread that runs a communicator's MPI calls, and their works),
:mod:`.device` (CUDA buffers: CUDA-awareness detection, CuPy views, host staging), :mod:`.ops16`
(16-bit user-defined reduction ops), :mod:`.scratch` (float32 upcast buffers), :mod:`.dtypes`
(dtype and op maps), :mod:`.support` (the capability answers), :mod:`.abort` (aborting the job
when a rank dies of an uncaught error).

Importing this package starts nothing: :mod:`.communicator` imports ``mpi4py.MPI``, which
initialises MPI, and is imported only when the backend is chosen.
"""
