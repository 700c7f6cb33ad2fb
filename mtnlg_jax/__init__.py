"""mtnlg_jax: Megatron-Turing NLG style GPT training in JAX with 3D parallelism."""
