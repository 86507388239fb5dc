"""Training code for the embedded ``ditattn:shapes`` model (not imported by the runtime).

``scenes``: procedural clips and captions; ``recipe``: the component configurations and building
fresh models; ``flow``: flow-matching pieces (timestep shift, the padded-text attention bias);
``log``: loss log, plot, EMA, progress; ``vae_stage`` / ``dit_stage``: the two training stages;
``shapes``: the command line (``python -m ditattn.train.shapes --help``); ``merge``: joins a DiT run
and a decoder-only VAE run of one package; ``reference``: writes the golden reference clip of the tests.

Dependencies point one way: this package imports :mod:`ditattn.models` (the packaged-weights
format, the byte tokenizer) and :mod:`ditattn.pipelines` (to sample from what it trained); nothing
in the runtime imports it.
"""
