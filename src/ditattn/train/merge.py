"""Join a decoder-only VAE run and a DiT run that continued from the same ``ditattn:shapes`` package.

``--stage vae --vae-train decoder --resume P`` never changes the encoder (nor the latent mean / std),
so the latents a DiT trained on stay valid; and ``--stage dit --resume P`` keeps ``P``'s VAE frozen.
The two runs can therefore train at the same time (two processes on one GPU), and this module writes
the DiT run's text encoder + DiT with the decoder run's VAE::

    python -m ditattn.train.merge --dit DIT_OUT --decoder DECODER_OUT --out MERGED

It refuses (one line, exit status 2) when the two packages do not share the encoder bit for bit, or
when their architectures differ: then the latents are not the same and the merged model would be wrong.
"""

from __future__ import annotations

import argparse
import copy
import sys

LATENT_PREFIXES = ("vae.encoder.", "vae.quant_conv.")
HINT = "the decoder run must train the decoder only (--vae-train decoder) from the package the DiT run resumed"


class MergeError(ValueError):
    """The two packages cannot be merged (the reason is the message)."""


def _load(folder: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    from ditattn.models.shapes import package_files, read_meta

    return read_meta(folder), load_file(package_files(folder)[1])


def merge_packages(dit_dir: str, decoder_dir: str) -> tuple[dict, dict]:
    """``(meta, state_dicts)`` of the merged package: ``dit_dir``'s text encoder and transformer with
    ``decoder_dir``'s VAE.  Raises :class:`MergeError` when ``decoder_dir`` is not a decoder-only run, or
    the encoders (``vae.encoder.*``, ``vae.quant_conv.*``), the latent statistics or any component's
    architecture differ."""
    import torch

    dit_meta, dit_t = _load(dit_dir)
    dec_meta, dec_t = _load(decoder_dir)
    vae_stage = dec_meta.get("training", {}).get("stages", {}).get("vae") or {}
    if vae_stage.get("train_encoder") is not False:  # e.g. the two folders swapped: the merge would change nothing
        raise MergeError(f"{decoder_dir} is not a decoder-only run (its VAE stage trained the encoder too); {HINT}")
    for comp in ("text_encoder", "transformer"):
        if dit_meta["components"][comp] != dec_meta["components"][comp]:
            raise MergeError(f"the {comp} architectures differ between {dit_dir} and {decoder_dir}")
    dit_vae, dec_vae = dit_meta["components"]["vae"], dec_meta["components"]["vae"]
    if dit_vae != dec_vae:
        keys = sorted(k for k in set(dit_vae) | set(dec_vae) if dit_vae.get(k) != dec_vae.get(k))
        raise MergeError(f"the VAE configs differ ({', '.join(keys)}): the latents are not the same; {HINT}")
    if set(dit_t) != set(dec_t):
        raise MergeError("the two packages hold different tensors (another architecture)")
    changed = [k for k in dit_t if k.startswith(LATENT_PREFIXES) and not torch.equal(dit_t[k], dec_t[k])]
    if changed:
        raise MergeError(
            f"the encoders differ ({len(changed)} tensors, e.g. {changed[0]}): the latents are not the same; {HINT}"
        )
    state: dict = {"text_encoder": {}, "transformer": {}, "vae": {}}
    for key, tensor in dit_t.items():
        comp, name = key.split(".", 1)
        state[comp][name] = dec_t[key] if comp == "vae" else tensor
    meta = copy.deepcopy(dit_meta)
    meta.pop("format", None)
    training = meta.setdefault("training", {})
    training.setdefault("stages", {})["vae"] = vae_stage
    training["merged"] = {
        "dit_from": dit_meta.get("training", {}).get("commit"),
        "vae_from": dec_meta.get("training", {}).get("commit"),
        "note": "text encoder + DiT of one run, VAE (decoder retrained, encoder unchanged) of another",
    }
    return meta, state


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ditattn.train.merge",
        description="Write a ditattn:shapes package with one run's text encoder + DiT and another run's "
        "decoder-only VAE (both continued from the same package).",
    )
    p.add_argument("--dit", required=True, help="package folder of the --stage dit run")
    p.add_argument("--decoder", required=True, help="package folder of the --stage vae --vae-train decoder run")
    p.add_argument("--out", required=True, help="folder to write shapes.json + shapes.safetensors into")
    args = p.parse_args(argv)
    from ditattn.errors import AttentionConfigError
    from ditattn.models.shapes import write_package

    try:
        meta, state = merge_packages(args.dit, args.decoder)
    except (MergeError, AttentionConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    meta_path, _ = write_package(args.out, meta, state)
    print(f"merged: {meta_path} (DiT from {args.dit}, VAE from {args.decoder})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
