"""rollstream: asynchronous rollout pipeline for group-based RL over Redis Streams."""
