"""Adapters that speak an inference engine's conventions.

`fa3_spec.integrations.sglang` fills the CUDA-graph metadata buffers of
sglang's FlashAttention backend from fa3_spec's builders (see
``docs/engines.md``).
"""
