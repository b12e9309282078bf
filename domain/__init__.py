"""What the rollout side and the trainer both use: environments and verifiers, tokenizers,
the tiny model."""
