"""Which torch.distributed backend a stage process joins the process group with.

Every process of a run joins one process group. Gloo carries everything on CPU (the
pipeline's point-to-point tensors, the parameter-server messages, barriers). Under the
``allreduce`` rule on real CUDA devices the gradient ``all_reduce`` goes through NCCL, as the
old DDP baseline did: the group is then ``cpu:gloo,cuda:nccl``, so CUDA tensors take NCCL and
CPU tensors still take gloo (guarded: nothing else changes, and an emulated or CPU-only run
stays on gloo). Such a process first makes its plan GPU the current CUDA device
(:func:`runtime.stage.device.cuda_index`), so NCCL's collectives (a barrier included) never put two ranks on one
GPU.
"""

from __future__ import annotations

__all__ = ["GLOO", "GLOO_NCCL", "stage_backend"]

GLOO = "gloo"
GLOO_NCCL = "cpu:gloo,cuda:nccl"  # per device type: CUDA tensors over NCCL, CPU over gloo


def stage_backend(layout: str, emulated: bool, cuda_available: bool) -> str:
    """The backend of a stage process: NCCL for CUDA tensors under a ``ddp`` layout (the
    ``allreduce`` rule) on real GPUs.

    Args:
        layout: how the run's synchronisation rule is laid out
            (:attr:`planner.rules.SyncRule.layout`; :attr:`runtime.sync.rule.SyncSpec.layout`).
        emulated: the stage runs on an emulated device (paced or memory-capped CPU process).
        cuda_available: ``torch.cuda.is_available()`` in the stage's process.

    >>> stage_backend("ddp", emulated=False, cuda_available=True)
    'cpu:gloo,cuda:nccl'
    >>> stage_backend("ddp", emulated=False, cuda_available=False)
    'gloo'
    >>> stage_backend("shards", emulated=False, cuda_available=True)
    'gloo'
    """
    return GLOO_NCCL if layout == "ddp" and not emulated and cuda_available else GLOO
