"""Imported by vLLM inside its model-running processes (`worker_extension_cls`):
- the methods it mixes into each rank, so the harness can ask, through
  `LLM.collective_rpc("hostsweep_allreduce")`, which all-reduce path a TP rank uses;
- on import, the torch profiler's CPU-time table switched off. vLLM builds that table
  (`key_averages().table(...)`, ~117 lines) at every stop_profile when only CPU activity is
  recorded, prints it and writes a .profiler_out.txt, and no setting turns it off on the CPU
  build; the split reads the chrome trace, never the table, and building it costs 2-3 s per
  stop (measured in benchmarks/RESULTS.md, "The split without gzip and without the
  profiler table").

Keep it free of everything but torch and vLLM.
"""
from __future__ import annotations

import sys


def _quiet_profiler_tables() -> bool:
    """No CPU- or device-time summary tables at stop_profile; True if vLLM's wrapper was found.
    Only inside a process that runs vLLM (vLLM imports this module there): imported anywhere
    else, this module imports nothing of vLLM's."""
    if "vllm" not in sys.modules:
        return False
    try:
        from vllm.profiler import wrapper
    except ImportError:
        return False
    cls = getattr(wrapper, "TorchProfilerWrapper", None)
    if cls is None or getattr(cls, "_hostsweep_quiet", False):
        return cls is not None
    init = cls.__init__

    def quiet_init(self, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        init(self, *args, **kwargs)
        self.dump_cpu_time_total = False
        self.dump_device_time_total = False

    cls.__init__ = quiet_init
    cls._hostsweep_quiet = True
    return True


_quiet_profiler_tables()  # on import: in each process vLLM loads this extension into

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
