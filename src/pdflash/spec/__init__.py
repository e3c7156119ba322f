"""Speculative decoding: the DFlash drafter, route projection, the per-sequence round seam
(SpecSession / Speculator) and drafter training."""
