"""Login-node side of megatron-rl: config, planning and submission. Never imports torch or megatron."""
