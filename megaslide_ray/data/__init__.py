"""Data: what the model trains on, and where it comes from.

``manifest`` (the video manifest), ``index`` (a manifest from a folder of videos and images),
``captions`` (captions as bytes), ``clips`` (the rules that turn a video row into a clip, shared
by the decoder actors, validation and precompute), ``buckets`` (rows to ``data.buckets`` and the
order of bucketed batches), ``latents`` (the latent manifest and its files), ``encoders`` (the
VAE and text encoders, one plain class) and ``latent_cache`` (the folder precompute fills, and
what of it is done; ``pipelines/`` runs the encoders), ``demo`` and ``motion`` (the built-in data
sets), ``folders`` (building a data set folder atomically) and ``checks`` (is the data what the
model reads?)."""
