"""The transports behind :class:`~gradcomm.comm.Communicator`.

:mod:`.gloo` and :mod:`.nccl` over torch.distributed process groups (:mod:`.torch_dist`),
:mod:`.mpi` over mpi4py (CPU and CUDA buffers), :mod:`.cupy_nccl` over CuPy's NCCL; each is
imported only when chosen (:mod:`gradcomm.comm.launch.registry`). :mod:`.threads` is a test
double: ranks as threads of one process, not a backend users can choose.
"""
