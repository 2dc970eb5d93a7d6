"""The training loops and what they share: the engine, steps, checkpoints, evaluation, the critic."""
