"""KDA kernels in Mosaic GPU (Hopper: TMA copies, wgmma products; Mosaic GPU's interpreter on CPU):
the intra stage's pair kernel and the inter stage, whole or in time segments."""
