"""The target model family and its loading: config, checkpoint files, the Qwen3-MoE forward,
attention, RoPE, the KV cache, the expert-provider seam, the tokenizer and the AR reference loop."""
