"""Methods vLLM mixes into its TP>1 workers (`worker_extension_cls`), so the harness can ask
each rank, through `LLM.collective_rpc("hostsweep_allreduce")`, which all-reduce path it uses.

Imported inside vLLM's worker processes: keep it free of everything but torch and vLLM.
"""
from __future__ import annotations

# CUDA all-reduce paths a CudaCommunicator may hold; the first enabled one serves small
# tensors, pynccl the rest.
_CUDA_PATHS = ("qr_comm", "ca_comm", "symm_mem_comm", "pynccl_comm")


class HostsweepWorkerExtension:
    def hostsweep_allreduce(self) -> str:
        """e.g. 'CpuCommunicator/_CPUSHMDistributed (gloo)' or
        'CudaCommunicator/ca_comm+pynccl_comm (nccl)'."""
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        backend = dist.get_backend(group.device_group)
        comm = group.device_communicator
        if comm is None:
            return f"torch.distributed ({backend})"
        paths = [name for name in _CUDA_PATHS
                 if getattr(comm, name, None) is not None and not getattr(getattr(comm, name), "disabled", False)]
        module = getattr(comm, "dist_module", None)
        inner = "+".join(paths) or ("torch.distributed" if module is dist else type(module).__name__)
        return f"{type(comm).__name__}/{inner} ({backend})"
