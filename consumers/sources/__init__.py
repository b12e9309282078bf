"""Session sources a rollout consumer runs, and how a consumer finds one from its config.

A source is named `module:factory` (`ConsumerConfig.source`) and built as
`factory(**ConsumerConfig.source_args)`; it implements `run(request) -> Session` (run in a
thread) or `async arun(request) -> Session` (see `pipeline.sessions`).

- `consumers.sources.sleep:SleepSource`: log-normal sleeps with fake calls (benchmarks).
- `consumers.sources.scripted:ScriptedSource`: outcomes scripted per task, sample and
  attempt (tests).
- `consumers.sources.policy:PolicySource`: an in-process policy (the tiny model or a Hugging
  Face causal LM on CPU) against an environment of `domain.envs`.
- `consumers.sources.prompts:PromptSetSource`: a single-turn prompt set with a verifier.
- `consumers.sources.harness:HarnessSource`: an agent harness behind the recording gateway
  (docs/harness.md).
- `consumers.sources.completions:CompletionsSource`: plain tasks of those environments
  sampled by an OpenAI-compatible engine (vLLM, SGLang) through the recording gateway
  (docs/engines.md).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from pipeline.errors import ConfigError
from pipeline.sessions import is_async_source


def import_object(spec: str, field: str) -> Any:
    """The object `module:name` (or `module:name.attr`) names; what cannot be imported is a
    ConfigError naming `field`. A module is looked up on `sys.path`, which under `rollstream`
    and `python -m` includes the current folder."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{field}: must be module:name, got {spec!r}")
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{field}: cannot import {module_name} ({type(exc).__name__}: {exc}); it must be "
                          f"importable from the current folder or PYTHONPATH") from exc
    for part in attr.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise ConfigError(f"{field}: {module_name} has no {attr} ({spec!r})") from None
    return found


def load_source(spec: str, args: Mapping[str, Any] | None = None) -> Any:
    """Build the source `spec` (`module:factory`) names with keyword arguments `args`; a
    source that cannot be imported, or arguments it does not take or refuses, are a
    ConfigError naming `source` or `source_args`."""
    factory = import_object(spec, "source")
    kwargs = dict(args or {})
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"source_args: {spec} does not take them: {exc}") from None
    except ValueError:  # a callable without a signature (a C type): let the call decide
        pass
    try:
        source = factory(**kwargs)
    except ConfigError:
        raise
    except (ValueError, OSError) as exc:
        raise ConfigError(f"source_args: {spec} refused them: {exc}") from exc
    is_async_source(source)  # refuses an object that is not a source
    return source
