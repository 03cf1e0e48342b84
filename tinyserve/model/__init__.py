"""Config parsing, checkpoint loading, layers and the Qwen3.5-MoE model."""
