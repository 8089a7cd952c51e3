"""How a process finds its place in a job and gets its communicator.

:mod:`.launcher` reads the launcher's environment (torchrun, MPI launchers, SLURM) without
starting MPI; :mod:`.selection` chooses the backend and builds the communicator
(:func:`gradcomm.init`), with :mod:`.registry` mapping names to backends; :mod:`.rendezvous`
builds the store the torch.distributed backends meet over, choosing an address that every rank
reaches (:mod:`.netaddr`, :mod:`.reachability`); :mod:`.agreement` checks that the ranks' settings
agree before any backend starts; :mod:`.env` reads on/off switches from the environment.
"""
