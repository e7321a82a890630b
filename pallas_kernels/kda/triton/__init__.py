"""KDA kernels in Pallas-Triton (GPU; interpret mode on CPU): the intra stage's Triton kernels, the
inter stage's serial loops, the state recurrences, the backward's passes and the decode step."""
