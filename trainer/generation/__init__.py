"""Models and generation: loading, LoRA, attention, tokenising, rollouts and the rollout-engine seam, ranks."""
