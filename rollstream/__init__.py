"""The application: every `rollstream` command, the benchmarks, the demo and the tools
that run a whole pipeline."""
