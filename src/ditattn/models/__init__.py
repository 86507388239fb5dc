"""Native model implementations built on :mod:`ditattn.attention.layer`.

``wan``: the Wan 2.1/2.2 video DiT (``WanTransformer3DModel`` weights unchanged); ``umt5``: the
UMT5 text encoder (``UMT5EncoderModel`` weights unchanged); ``tiny``: the built-in tiny checkpoints
``ditattn:tiny-wan`` / ``ditattn:tiny-wan2.2``; ``weights``: checkpoint file loading.
"""
