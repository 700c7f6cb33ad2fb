"""Hugging Face checkpoints to and from our parameter names (safetensors, no torch).

hf_gpt2.py   GPT2LMHeadModel <-> the GPT block
"""
