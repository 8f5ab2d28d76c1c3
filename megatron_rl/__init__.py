"""Job side of megatron-rl: Megatron Core runtime, trainers, generation, checkpoints and conversion."""
