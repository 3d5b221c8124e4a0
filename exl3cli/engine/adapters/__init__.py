"""LoRA adapters: PEFT files read and checked (peft.py), applied per token row (lora.py)."""
