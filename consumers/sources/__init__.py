"""Session sources a rollout consumer runs, and how a consumer finds one from its config.

A source is named `module:factory` (`ConsumerConfig.source`) and built as
`factory(**ConsumerConfig.source_args)`; it implements `run(request) -> Session` (run in a
thread) or `async arun(request) -> Session` (see `pipeline.sessions`).

- `consumers.sources.sleep:SleepSource`: log-normal sleeps with fake calls (benchmarks).
- `consumers.sources.scripted:ScriptedSource`: outcomes scripted per task, sample and
  attempt (tests).
- `consumers.sources.policy:PolicySource`: an in-process policy (the tiny model or a Hugging
  Face causal LM on CPU) against an environment of `consumers.sources.envs`.
- `consumers.sources.prompts:PromptSetSource`: a single-turn prompt set with a verifier.
- `consumers.sources.harness:HarnessSource`: an agent harness behind the recording gateway
  (docs/harness.md).
- `consumers.sources.completions:CompletionsSource`: plain tasks of those environments
  sampled by an OpenAI-compatible engine (vLLM, SGLang) through the recording gateway
  (docs/engines.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from pipeline.sessions import is_async_source


def load_source(spec: str, args: Mapping[str, Any] | None = None) -> Any:
    """Build the source `spec` (`module:factory`) names with keyword arguments `args`."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"source must be module:factory, got {spec!r}")
    factory: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        factory = getattr(factory, part)
    source = factory(**dict(args or {}))
    is_async_source(source)  # refuses an object that is not a source
    return source
