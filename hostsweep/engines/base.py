"""The engine interface the worker measures through, and the lazy engine loader."""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Optional, Protocol

from hostsweep.config.grid import EngineSpec
from hostsweep.config.schema import ENGINES


class Engine(Protocol):
    """A started inference engine serving one EngineSpec."""

    # Whether it runs in processes of its own (vLLM's EngineCore and workers), which the
    # worker watches for deaths. An engine that does not must say so: the processes the
    # worker's other threads start meanwhile (a `git` for provenance) are not the engine's.
    starts_processes: bool

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        """Greedy-decode exactly `max_tokens` per prompt; return each output's length."""
        ...

    def last_tokens(self) -> list[list[int]]:
        """The token ids each request of the last generate produced."""
        ...

    def spec_stats(self) -> Optional[list[dict[str, Any]]]:
        """Per request of the last generate, the speculative-decoding counts vLLM reports
        (num_spec_steps, num_draft_tokens, num_accepted_draft_tokens, num_spec_tokens);
        None for an engine that does not speculate."""
        ...

    def start_profile(self, prefix: str) -> None:
        """Start the engine-process profiler (every rank) for one generate."""
        ...

    def stop_profile(self, prefix: str) -> list[Path]:
        """Stop it; return one chrome trace per rank, in rank order."""
        ...

    def describe(self) -> dict[str, str]:
        """Versions and device name, for provenance tags."""
        ...

    def vocab_size(self) -> int:
        """Token ids in [0, vocab_size) are valid prompt tokens."""
        ...

    def close(self) -> None:
        ...


def start_engine(spec: EngineSpec, workdir: Path) -> Engine:
    """Import and start the engine named by the spec."""
    module_name, class_name = ENGINES[spec.engine].split(":")
    engine_class = getattr(importlib.import_module(module_name), class_name)
    return engine_class(spec, workdir)
