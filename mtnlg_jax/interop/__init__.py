"""Hugging Face checkpoints to and from our parameter names (safetensors, no torch).

safetensors_files.py  model.safetensors or shards with their index, tensor by tensor
hf_gpt2.py            GPT2LMHeadModel <-> the GPT block
hf_llama.py           LlamaForCausalLM <-> the Llama block (both config.json layouts); the
                      tensors of its variants (q/k norms, per-expert MoE tensors)
hf_variants.py        Qwen3, Mixtral and Qwen3-MoE config.json <-> model keys (both layouts)
"""
