"""gradcomm as a torch.distributed backend: ``init_process_group("gradcomm")``.

``import gradcomm`` registers the backend (:func:`register`); then torch's DDP, FSDP2, DTensor
and the functions of ``torch.distributed`` run over gradcomm's transports::

    import torch.distributed as dist, gradcomm
    dist.init_process_group("gradcomm")        # under torchrun, mpiexec or srun
    model = torch.nn.parallel.DistributedDataParallel(model)

The transport per device type: ``Options(transport=...)`` given as ``pg_options`` >
``GRADCOMM_BACKEND`` > auto (:mod:`~gradcomm.torch_backend._options`). Guide: docs/torch-backend.md.
"""

from ._options import Options
from ._process_group import ProcessGroupGradcomm
from ._registration import BACKEND_NAME, register
from ._work import GradcommWork

__all__ = ["BACKEND_NAME", "Options", "ProcessGroupGradcomm", "GradcommWork", "register"]
