"""The models: ``videodit`` (ours) and ``wan`` (Wan 2.x, diffusers' names), with 3D-DSA.

``registry`` is where ``model.arch`` is read: ``build_shard``, ``num_shards``,
``initialize_shard``, ``param_count`` and ``build_model`` dispatch to the architecture.
``attention`` is where ``attention.kind`` is read: both architectures call its
``self_attention`` (whole clips) and ``chunked_self_attention`` (``runtime.token_chunk``).
``chunking`` runs a block's per-token parts over chunks, ``shards`` is the flat shard layout,
``wan_diffusers`` converts diffusers configs and weights, ``prediction`` says what a model
output means (a velocity, or a clean-clip estimate turned into one)."""
