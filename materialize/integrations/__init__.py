"""What other libraries bring: Hugging Face models and the hub, DTensor shards, device maps."""
