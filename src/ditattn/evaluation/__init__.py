"""Quality evaluation of attention settings: paired comparisons of whole generations
(:mod:`.compare`, its report and files :mod:`.report`), image metrics (:mod:`.metrics`),
attention-layer capture (:mod:`.capture`) and the structured attention inputs of the fidelity
benchmark (:mod:`.structured`).

Nothing here downloads weights: the image metrics are torchmetrics' PSNR / SSIM / MS-SSIM.
"""
